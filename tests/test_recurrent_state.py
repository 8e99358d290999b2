"""The commit of a hybrid target's recurrent (linear-attention) state after a verify (serving/recurrent_state.py):
which verify step's state each request keeps, and which one the radix cache snapshots; both commit paths (SGLang's
snapshot scatter, and the replay of --enable-linear-replayssm-spec) run with SGLang's kernels on a simulated Gated
DeltaNet target (tests/replay_commit_sim.py: Triton's interpreter on CPU, natively on a GPU) against the state after
running only the committed tokens; the replay pool's memory plan (tests/replay_pool_probe.py: SGLang's configurator on
the Qwen3.5-35B-A3B shape); start-up turning the flag on (startup.check_replay_ssm)."""

from __future__ import annotations

from types import SimpleNamespace

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from _interpreter import needs_gpu, run_interpreted  # noqa: E402

from sglang_dflash import settings  # noqa: E402
from sglang_dflash.serving import compat, recurrent_state, startup  # noqa: E402
from sglang_dflash.serving.recurrent_state import RecurrentStateCommit, boundary_steps  # noqa: E402

SIM = Path(__file__).with_name("replay_commit_sim.py")
POOL_PROBE = Path(__file__).with_name("replay_pool_probe.py")


def _replay_boundary_step(prefix: int, commit: int, interval: int) -> int:
    """Walk the committed tokens one by one: the step after which the length is a multiple of interval."""
    for i in range(commit):
        if (prefix + i + 1) % interval == 0:
            return i
    return -1


@pytest.mark.parametrize("interval", [16, 64])
def test_boundary_steps_match_a_token_by_token_replay(interval):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 300, (500,), generator=g)
    commit = torch.randint(1, 17, (500,), generator=g)
    got = boundary_steps(prefix, commit, interval)
    want = [_replay_boundary_step(int(p), int(c), interval) for p, c in zip(prefix, commit)]
    assert got.tolist() == want
    assert (got >= 0).any() and (got < 0).any()


class FakeBackend:
    def __init__(self):
        self.calls = []

    def update_mamba_state_after_mtp_verify(self, **kw):
        self.calls.append(kw)


def _commit_for(monkeypatch, hybrid: bool):
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(arch, "mambaish_config", lambda mc: object() if hybrid else None)
    runner = SimpleNamespace(model_config=None, model="target", attn_backend=FakeBackend())
    return RecurrentStateCommit(runner), runner


def test_each_request_keeps_the_state_after_its_committed_tokens(monkeypatch):
    commit, runner = _commit_for(monkeypatch, hybrid=True)
    width_backend = FakeBackend()  # the verify ran on another width's backend: that one's metadata is used
    batch = SimpleNamespace(mamba_track_indices=None)
    commit.after_accept(width_backend, batch, torch.tensor([5, 9]), torch.tensor([1, 16], dtype=torch.int32), 16)
    (call,) = width_backend.calls
    assert call["last_correct_step_indices"].tolist() == [0, 15] and call["mamba_steps_to_track"] is None
    assert call["model"] == "target" and not runner.attn_backend.calls


def test_no_recurrent_layers_no_commit(monkeypatch):
    commit, runner = _commit_for(monkeypatch, hybrid=False)
    backend = FakeBackend()
    commit.after_accept(backend, SimpleNamespace(mamba_track_indices=None), torch.tensor([1]), torch.tensor([2]), 4)
    assert not backend.calls and not commit.active


def test_a_hybrid_target_whose_backend_cannot_restore_state_is_refused(monkeypatch):
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(arch, "mambaish_config", lambda mc: object())
    runner = SimpleNamespace(model_config=None, model=torch.nn.Identity(), attn_backend=object())
    with pytest.raises(RuntimeError, match="cannot restore their state.*Fix"):
        RecurrentStateCommit(runner)


# ----------------------------------------------------------------------------------- the replay commit (issue #44)
def _replay_runner(monkeypatch, replay: bool, backend=None):
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(arch, "mambaish_config", lambda mc: object())
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(enable_linear_replayssm_spec=replay))
    return SimpleNamespace(model_config=None, model="target", req_to_token_pool=pool,
                           attn_backend=backend if backend is not None else FakeBackend())


@pytest.mark.parametrize("k", [0, 3, 7, 15])
def test_replay_pool_commits_through_sglangs_replay_at_every_width(monkeypatch, k):
    """With a replay pool that does not fold at every commit (another SGLang's, KDA) the commit is SGLang's (EAGLE's)
    commit_mamba_states_after_verify: the committed counts,
    and a chain's accept index (row i's verify rows i*W .. i*W+W-1) at this step's width, k = 0 included; the
    width's backend scatter is not called (the pool holds no snapshots to scatter)."""
    import sglang.srt.speculative.spec_utils as spec_utils

    calls = []
    monkeypatch.setattr(spec_utils, "commit_mamba_states_after_verify", lambda *a: calls.append(a))
    runner = _replay_runner(monkeypatch, replay=True)
    commit = RecurrentStateCommit(runner)
    assert commit.active and commit.replay
    W, backend = k + 1, FakeBackend()
    batch = SimpleNamespace(mamba_track_indices=None)
    commit_lens = torch.tensor([1, W, max(W - 1, 1)], dtype=torch.int32)
    commit.after_accept(backend, batch, torch.tensor([4, 8, 12]), commit_lens, W)
    (target, got_batch, got_lens, accept_index, width), = calls
    assert target.model_runner is runner and got_batch is batch and got_lens is commit_lens and width == W
    assert accept_index.tolist() == [[i * W + j for j in range(W)] for i in range(3)]
    assert not backend.calls and not runner.attn_backend.calls


@pytest.mark.parametrize("track", [False, True])
def test_the_fold_pool_is_folded_directly_with_a_chains_steps(monkeypatch, track):
    """SGLang 0.5.17's replay pool folds at every commit: we call its fold with commit_lens, the last committed step
    commit_lens - 1 and (radix track slots) the crossed boundary's step from the lengths before the verify, the
    indices SGLang's EAGLE commit derives from a chain's accept index, without its ~12 extra launches."""
    import sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold as fold
    import sglang.srt.runtime_context as runtime_context
    import sglang.srt.speculative.spec_utils as spec_utils

    calls = []
    monkeypatch.setattr(fold, "commit_gdn_replayssm_fold_after_verify", lambda **kw: calls.append(kw))
    monkeypatch.setattr(spec_utils, "commit_mamba_states_after_verify", lambda *a: pytest.fail("SGLang's commit"))
    monkeypatch.setattr(runtime_context, "get_exec",
                        lambda: SimpleNamespace(mamba=SimpleNamespace(mamba_track_interval=8)))
    runner = _replay_runner(monkeypatch, replay=True)
    spec, slots = object(), torch.tensor([7, 2, 5])
    runner.req_to_token_pool.mamba_pool.replayssm_spec_fold = True
    runner.req_to_token_pool.get_speculative_mamba2_params_all_layers = lambda: spec
    runner.req_to_token_pool.get_mamba_indices = lambda req: slots[req]
    seq_lens, commit_lens = torch.tensor([4, 7, 12]), torch.tensor([5, 1, 3], dtype=torch.int32)
    batch = SimpleNamespace(req_pool_indices=torch.tensor([0, 1, 2]), seq_lens=seq_lens,
                            mamba_track_indices=torch.tensor([9, 10, 11]) if track else None)
    RecurrentStateCommit(runner).after_accept(FakeBackend(), batch, seq_lens, commit_lens, 16)
    (kw,) = calls
    assert kw["spec_state"] is spec and kw["state_batch_indices"].tolist() == [7, 2, 5]
    assert kw["accept_lens"] is commit_lens and kw["last_correct_step_indices"].tolist() == [4, 0, 2]
    assert kw["mamba_track_indices"] is batch.mamba_track_indices
    # 4 -> 9 crosses 8 after its step 3; 7 -> 8 ends on it at step 0; 12 -> 15 crosses nothing
    assert (kw["mamba_steps_to_track"].tolist() if track else kw["mamba_steps_to_track"]) == (
        [3, 0, -1] if track else None)


def test_the_replay_pool_needs_no_backend_scatter(monkeypatch):
    """The snapshot path's refusal (no update_mamba_state_after_mtp_verify) does not apply to the replay pool."""
    assert RecurrentStateCommit(_replay_runner(monkeypatch, replay=True, backend=object())).replay
    with pytest.raises(RuntimeError, match="cannot restore their state"):
        RecurrentStateCommit(_replay_runner(monkeypatch, replay=False, backend=object()))


def test_the_pool_decides_the_path(monkeypatch):
    """The flag alone does not build the window (e.g. SGLang's unified memory pool): the pool is asked."""
    assert recurrent_state.replay_pool(SimpleNamespace(mamba_pool=SimpleNamespace(enable_linear_replayssm_spec=True)))
    assert not recurrent_state.replay_pool(SimpleNamespace(mamba_pool=SimpleNamespace()))
    assert not recurrent_state.replay_pool(SimpleNamespace()) and not recurrent_state.replay_pool(None)
    assert not RecurrentStateCommit(_replay_runner(monkeypatch, replay=False)).replay


@pytest.fixture(scope="module")
def simulated():
    """tests/replay_commit_sim.py under Triton's interpreter (SGLang's GDN verify and fold kernels on CPU)."""
    return run_interpreted(str(SIM), timeout_s=600)


@pytest.mark.slow  # the interpreted kernels: ~30 s for the module's cases
@pytest.mark.parametrize("case", ["replay", "replay_track", "snapshot", "snapshot_track", "in_place", "in_place_track"])
def test_committed_state_is_the_state_after_only_the_committed_tokens(simulated, case):
    """k = 15, 0, 3, 7 in turn; after each commit every request's Gated DeltaNet state (all layers), conv window and
    (extra_buffer) radix track slot equal running only its committed tokens, bit for bit; other slots untouched.
    in_place: SGLANG_DFLASH_K0_STATE_IN_PLACE=1, the verify through our hook (at k = 0 SGLang's decode kernels, in
    place, held to plain decoding of the token bit for bit and to the verify kernel's state up to rounding)."""
    r = simulated[case]
    assert r["equal"], f"{case}: max |commit - committed-only run| = {r['max_err']}"
    assert r["max_err"] == 0.0
    if case.endswith("_track"):
        assert r["tracked"] > 0  # some commits crossed a snapshot boundary
    if case == "in_place_track":
        assert r["tracked_k0"] > 0  # ... at a k = 0 step too: the track copy after an in-place update


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bug_all_verified", "bug_one_short", "bug_slots",
                                  "bug_snapshot_scatter_on_replay_pool", "bug_fold_after_in_place",
                                  "bug_in_place_commit_without_hook"])
def test_planted_bugs_fail_the_check(simulated, case):
    assert not simulated[case]["equal"], f"{case}: the check did not see the planted bug"


@needs_gpu
def test_committed_state_on_the_gpu():
    """The same simulation with SGLang's kernels compiled (and its CUDA conv-window scatter instead of the CPU run's
    torch stand-in)."""
    out = subprocess.run([sys.executable, str(SIM), "--cuda"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for case, r in results.items():
        if case == "seconds":
            continue
        assert r["equal"] == (not case.startswith("bug_")), (case, r)


# ----------------------------------------------------------------------------- the pool and its memory plan (CPU)
@pytest.fixture(scope="module")
def pool_probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay_pool")
    r = subprocess.run([sys.executable, str(POOL_PROBE), str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ok(probe, key):
    r = probe[key]
    assert r["ok"], f"{key}: {r['error']}\n{r['traceback']}"
    return r


def test_replay_keeps_the_running_requests_of_plain_decoding(pool_probe):
    """Qwen3.5-35B-A3B's exact shape, SGLang's own memory plan on one budget (extra_buffer, as the launch preset):
    with state snapshots per draft position DFLASH runs a fraction of plain decoding's requests; with the replay at
    least 0.9x (the replay window, 16 tokens of raw k / v / gate / beta per state slot, costs ~8% of a slot)."""
    plain, snap, replay = (_ok(pool_probe, f"plan/{m}") for m in ("plain", "dflash", "dflash-replay"))
    assert not snap["flag"] and replay["flag"]
    assert snap["running"] < 0.3 * plain["running"]
    assert replay["running"] >= 0.9 * plain["running"], (plain, replay)
    assert replay["state_slots"] >= 0.9 * plain["state_slots"]


def test_the_replay_pool_is_built_for_dflash_with_our_hook(pool_probe):
    """SGLang refuses the replay pool for DFLASH on a non-KDA target (its own DFLASH commit is KDA-only); with the hook
    our worker installs it builds: no snapshots per draft position, a window of the block's 16 tokens per slot."""
    refused = pool_probe["pools/dflash-replay-without-hook"]
    assert not refused["ok"] and "requires a KDA" in refused["error"]
    snap, replay = _ok(pool_probe, "pools/dflash"), _ok(pool_probe, "pools/dflash-replay")
    assert snap["snapshots"] and not snap["replay_pool"] and snap["window"] is None
    assert replay["replay_pool"] and not replay["snapshots"]
    assert replay["window"][3] == replay["draft_tokens"] == 16  # [layers, slots, v heads, tokens, v dim]
    assert replay["running"] > 2 * snap["running"]


def test_cpu_start_keeps_the_snapshots(pool_probe):
    """Start-up does not turn the replay on on CPU (its kernels are CUDA Triton): the probe's DFLASH start is on CPU."""
    assert not _ok(pool_probe, "plan/dflash")["flag"]


# ------------------------------------------------------------------------------------- start-up (check_replay_ssm)
def _gpu_args(**kw):
    base = dict(device="cuda", linear_attn_decode_backend=None, linear_attn_backend="triton",
                enable_linear_replayssm=False, enable_linear_replayssm_spec=False, disaggregation_mode="null",
                enable_unified_memory=False)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture
def gdn_target(monkeypatch):
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(compat, "target_hf_config", lambda server_args: "hf")
    monkeypatch.setattr(compat, "REPLAY_SSM_AUTO", True)
    monkeypatch.delenv("SGLANG_DFLASH_REPLAY_SSM", raising=False)  # the default: on
    state = {"gdn": True}
    monkeypatch.setattr(arch, "hybrid_gdn_config", lambda mc: object() if state["gdn"] and mc.hf_config == "hf"
                        else None)
    return state


def test_startup_keeps_the_snapshots_when_the_replay_is_switched_off(gdn_target, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_DFLASH_REPLAY_SSM", "0")
    args = _gpu_args()
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        assert not startup.check_replay_ssm(args, args) and not args.enable_linear_replayssm_spec
    assert "SGLANG_DFLASH_REPLAY_SSM=0" in caplog.text


def test_startup_turns_the_replay_on_for_a_gdn_target(gdn_target, caplog):
    args = _gpu_args()
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        assert startup.check_replay_ssm(args, args)
    assert args.enable_linear_replayssm_spec
    assert "--enable-linear-replayssm-spec turned on" in caplog.text


def test_startup_leaves_other_targets_alone(gdn_target):
    gdn_target["gdn"] = False
    args = _gpu_args()
    assert not startup.check_replay_ssm(args, args) and not args.enable_linear_replayssm_spec


def test_startup_keeps_an_operators_flag(gdn_target, caplog):
    args = _gpu_args(device="cpu", enable_linear_replayssm_spec=True)  # even where start-up would not turn it on
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        assert startup.check_replay_ssm(args, args)
    assert args.enable_linear_replayssm_spec and "given" in caplog.text


@pytest.mark.parametrize("kw,why", [
    (dict(device="cpu"), "CUDA Triton"),
    (dict(linear_attn_decode_backend="cutedsl"), "needs triton or flashinfer"),
    (dict(enable_linear_replayssm=True), "refuses both together"),
    (dict(disaggregation_mode="prefill"), "runs no verify"),
    (dict(enable_unified_memory=True), "builds no replay window"),
])
def test_startup_keeps_the_snapshots_where_the_replay_cannot_apply(gdn_target, caplog, kw, why):
    args = _gpu_args(**kw)
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        assert not startup.check_replay_ssm(args, args)
    assert not args.enable_linear_replayssm_spec
    assert "snapshots per draft position kept" in caplog.text and why in caplog.text


def test_startup_keeps_the_snapshots_in_a_ragged_verify_mode(gdn_target, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    args = _gpu_args()
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        assert not startup.check_replay_ssm(args, args)
    assert "SGLANG_RAGGED_VERIFY_MODE" in caplog.text


def test_startup_does_not_turn_on_an_unchecked_replay_protocol(gdn_target, monkeypatch, caplog):
    """SGLang 0.5.23 replays GDN state by a circular history (compat.REPLAY_SSM_AUTO): the operator's flag only."""
    monkeypatch.setattr(compat, "REPLAY_SSM_AUTO", False)
    args = _gpu_args()
    with caplog.at_level(logging.INFO, logger="sglang_dflash"):
        assert not startup.check_replay_ssm(args, args)
    assert "pass --enable-linear-replayssm-spec" in caplog.text


# ------------------------------------------------------------------------- lifting SGLang's DFLASH + non-KDA refusal
def _flag_on(monkeypatch, on=True):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(mamba=SimpleNamespace(enable_linear_replayssm_spec=on)))
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(arch, "hybrid_gdn_config", lambda mc: object() if mc.gdn else None)


def _model(gdn=True):
    return SimpleNamespace(hf_config=object(), gdn=gdn)  # kimi_linear_config's answer for it: None (not KDA)


def test_refusal_lifted_for_the_call_only_0_5_17_style(monkeypatch):
    """0.5.17: the refusal asks the configurator module's global kimi_linear_config."""
    import sglang.srt.mem_cache.kv_cache_configurator as kvc

    _flag_on(monkeypatch)
    configurator = kvc.KVCacheConfigurator.__new__(kvc.KVCacheConfigurator)
    configurator.model_config = model = _model()
    probe = kvc.kimi_linear_config
    assert probe(model) is None
    with compat.replay_pool_for_gdn(configurator):
        assert kvc.kimi_linear_config(model) is not None
    assert kvc.kimi_linear_config is probe


def test_refusal_lifted_for_the_call_only_0_5_23_style(monkeypatch):
    """0.5.23: the refusal asks the configurator's field hybrid_kda_config."""
    _flag_on(monkeypatch)
    configurator = SimpleNamespace(model_config=_model(), hybrid_kda_config=None)
    with compat.replay_pool_for_gdn(configurator):
        assert configurator.hybrid_kda_config is not None
    assert configurator.hybrid_kda_config is None


@pytest.mark.parametrize("flag,gdn", [(False, True), (True, False)])
def test_refusal_untouched_without_the_flag_or_a_gdn_target(monkeypatch, flag, gdn):
    _flag_on(monkeypatch, flag)
    configurator = SimpleNamespace(model_config=_model(gdn), hybrid_kda_config=None)
    with compat.replay_pool_for_gdn(configurator):
        assert configurator.hybrid_kda_config is None


def test_no_pool_hook_without_the_flag(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(recurrent_state, "_POOL_HOOK_INSTALLED", False)
    recurrent_state.install_replay_pool_hook(SimpleNamespace(enable_linear_replayssm_spec=False))
    assert compat.HYBRID_REQ_POOL_HOOK not in HookRegistry._hooks


# ----------------------------------------------------------------- k = 0 in place (SGLANG_DFLASH_K0_STATE_IN_PLACE)
@pytest.mark.parametrize("on,fold,width,expect,unavailable", [
    (False, True, 1, "fold", False), (True, True, 1, "in place", False), (True, True, 4, "fold", False),
    (True, False, 1, "sglang", False), (True, True, 1, "fold", True)])
def test_in_place_commit_only_when_switched_on_at_one_token_on_a_fold_pool(monkeypatch, on, fold, width, expect,
                                                                          unavailable):
    """On (the default), only a one-token verify on a fold pool commits in place (its verify hook updated the state);
    wider verifies fold, a pool without the fold keeps SGLang's commit, and so does an SGLang on which the hook could
    not be installed (the default there: the fold), as with the switch off."""
    monkeypatch.setattr(recurrent_state, "_IN_PLACE_UNAVAILABLE", unavailable)
    import sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold as fold_mod
    import sglang.srt.speculative.spec_utils as spec_utils

    monkeypatch.setenv(settings.K0_STATE_IN_PLACE, "1" if on else "0")
    runner = _replay_runner(monkeypatch, replay=True)
    runner.req_to_token_pool.mamba_pool.replayssm_spec_fold = fold
    runner.req_to_token_pool.get_speculative_mamba2_params_all_layers = object
    runner.req_to_token_pool.get_mamba_indices = lambda req: req
    seen = []
    monkeypatch.setattr(fold_mod, "commit_gdn_replayssm_fold_after_verify", lambda **kw: seen.append("fold"))
    monkeypatch.setattr(spec_utils, "commit_mamba_states_after_verify", lambda *a: seen.append("sglang"))
    commit = RecurrentStateCommit(runner)
    monkeypatch.setattr(commit, "_commit_in_place", lambda batch, lens: seen.append("in place"))
    batch = SimpleNamespace(req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([4, 9]),
                            mamba_track_indices=None)
    commit.after_accept(FakeBackend(), batch, batch.seq_lens, torch.ones(2, dtype=torch.int32), width)
    assert commit.in_place == (on and fold and not unavailable) and seen == [expect]


def _fresh_hooks(monkeypatch) -> list:
    from sglang.srt.plugins.hook_registry import HookRegistry

    registered = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, hook, kind: registered.append(target))
    monkeypatch.setattr(HookRegistry, "apply_hooks", lambda: None)
    monkeypatch.setattr(recurrent_state, "_POOL_HOOK_INSTALLED", False)
    monkeypatch.setattr(recurrent_state, "_IN_PLACE_HOOK_INSTALLED", False)
    monkeypatch.setattr(recurrent_state, "_IN_PLACE_UNAVAILABLE", False)
    return registered


def test_in_place_hook_installed_unless_switched_off(monkeypatch):
    """On by default (2026-11-28: 212 / 212 greedy equal and 0.97-0.99x plain decoding on the Qwen3.5 shape,
    benchmarks/results/floor-qwen3.5-inplace-v2-h200); SGLANG_DFLASH_K0_STATE_IN_PLACE=0 keeps the fold at k = 0."""
    registered = _fresh_hooks(monkeypatch)
    args = SimpleNamespace(enable_linear_replayssm_spec=True)
    monkeypatch.setenv(settings.K0_STATE_IN_PLACE, "0")
    recurrent_state.install_replay_pool_hook(args)
    assert registered == [compat.HYBRID_REQ_POOL_HOOK]
    monkeypatch.delenv(settings.K0_STATE_IN_PLACE)
    recurrent_state.install_replay_pool_hook(args)
    assert registered == [compat.HYBRID_REQ_POOL_HOOK, compat.GDN_EXTEND_HOOK]


def test_in_place_default_folds_on_an_sglang_without_the_protocol(monkeypatch):
    """An SGLang whose GDN backend has no replay fold verify: by default the worker folds at k = 0 as at every
    width (no hook, and the commit must then not skip the fold: in_place False); asked for by name, a start-up
    error that names the fix."""
    from sglang.srt.layers.attention.linear import gdn_backend

    registered = _fresh_hooks(monkeypatch)
    monkeypatch.delattr(gdn_backend.GDNAttnBackend, "_replayssm_fold_target_verify")
    args = SimpleNamespace(enable_linear_replayssm_spec=True)
    monkeypatch.setenv(settings.K0_STATE_IN_PLACE, "1")
    with pytest.raises(recurrent_state.DFlashStartupError, match="Fix: unset"):
        recurrent_state.install_replay_pool_hook(args)
    monkeypatch.delenv(settings.K0_STATE_IN_PLACE)
    recurrent_state.install_replay_pool_hook(args)
    assert compat.GDN_EXTEND_HOOK not in registered and recurrent_state._IN_PLACE_UNAVAILABLE


@pytest.mark.parametrize("mode,width,fold", [("extend", 1, True), ("verify", 4, True), ("verify", 1, False)])
def test_in_place_hook_passes_everything_else_through(mode, width, fold):
    """A prefill (extend), a wider verify or a pool without the fold: SGLang's forward, untouched, with the arguments
    as given (the hook's test at one token per request is the simulation's in_place case, which runs the kernels)."""
    calls = []
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(enable_linear_replayssm_spec=True, replayssm_spec_fold=fold,
                                                      replayssm_is_kda=False))
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: mode == "verify"),
                            spec_info=SimpleNamespace(draft_token_num=width))
    backend = SimpleNamespace(req_to_token_pool=pool)
    out = recurrent_state.verify_one_token_as_decode(
        lambda *a, **kw: calls.append((a, kw)) or "sglang", backend, "layer", batch, mixed_qkv="x", a="a", b="b")
    assert out == "sglang" and calls == [((backend, "layer", batch), {"mixed_qkv": "x", "a": "a", "b": "b"})]


def test_in_place_hook_runs_the_decode_path_at_one_token(monkeypatch):
    seen = []
    monkeypatch.setattr(recurrent_state, "decode_one_token", lambda *a: seen.append(a) or "decode")
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(enable_linear_replayssm_spec=True, replayssm_spec_fold=True,
                                                      replayssm_is_kda=False))
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True),
                            spec_info=SimpleNamespace(draft_token_num=1))
    backend = SimpleNamespace(req_to_token_pool=pool)
    out = recurrent_state.verify_one_token_as_decode(lambda *a, **kw: "sglang", backend, q=None, layer="L",
                                                     forward_batch=batch, mixed_qkv="x", a="a", b="b")
    assert out == "decode" and seen == [(backend, "L", "x", "a", "b")]
