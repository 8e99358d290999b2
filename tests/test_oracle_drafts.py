"""Oracle drafts (benchmarks only, issue #45): the replacement op, its profile's law, the recording, the refusals.

The op (kernels/oracle_drafts.py) replaces a step's drafts by the recorded continuation, with a miss (a token certain
to be rejected) wherever the counter-based hash of (seed, prompt, output position) says so. Checked here: the
accepted length of a full-block step follows the stated geometric law (P(>= j) = p^j, mean 1 + p + ... + p^(B-1));
the same request gets the same drafts whatever the batch holds and in whatever order (so every method, concurrency
and rank sees the same events); positions without a recording keep the drafter's drafts; the bonus check counts a
divergence; the torch twin records no op a CUDA graph capture refuses (no host reads); the Triton kernel equals the
twin under Triton's interpreter (and on CUDA where present). The server path: tests/serving/test_oracle_cpu.py.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from _capturable import assert_capturable
from _interpreter import assert_all_equal, needs_gpu, print_interpreted, run_interpreted

from sglang_dflash import settings
from sglang_dflash.kernels.oracle_drafts import NO_DIVERGENCE, oracle_drafts_torch, position_hash
from sglang_dflash.settings import SettingsError

V, B = 1000, 16


def world(n_prompts=8, length=300, pool=40, seed=0):
    """A recording table and pool slots 0..n_prompts-1 pointing at rows in reverse order (prompt length 20 + i);
    slot n_prompts has no recording."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, V, (n_prompts, length), generator=g, dtype=torch.int32)
    table_len = torch.full((n_prompts,), length, dtype=torch.int64)
    slot_row = torch.full((pool,), -1, dtype=torch.int64)
    slot_plen = torch.zeros(pool, dtype=torch.int64)
    slot_key = torch.zeros(pool, dtype=torch.int64)
    for i in range(n_prompts):
        slot_row[i], slot_plen[i], slot_key[i] = n_prompts - 1 - i, 20 + i, (1_234_567 * (i + 1)) & 0x7FFFFFFF
    return dict(table=table, table_len=table_len, slot_row=slot_row, slot_plen=slot_plen, slot_key=slot_key,
                div_first=torch.full((n_prompts,), NO_DIVERGENCE, dtype=torch.int64),
                div_count=torch.zeros(n_prompts, dtype=torch.int64))


def step(w, slots, out_pos, k=B - 1, p=0.8, seed=0, bonus=None, drafts=None, fn=oracle_drafts_torch):
    """One replacement: requests in pool slots `slots` with their bonus at output positions `out_pos`; the bonus
    is the recorded token unless given, the drafter's drafts are -1 (visible when kept) unless given."""
    slots = torch.as_tensor(slots, dtype=torch.int64)
    t = torch.as_tensor(out_pos, dtype=torch.int64)
    prefix = w["slot_plen"][slots] + t
    rows = w["slot_row"][slots].clamp(min=0)
    if bonus is None:
        bonus = w["table"][rows, t].to(torch.int64)
    ids = torch.full((len(slots), k + 1), -1, dtype=torch.int64) if drafts is None else drafts.clone()
    ids[:, 0] = bonus
    fn(ids, prefix, slots, w["slot_row"], w["slot_plen"], w["slot_key"], w["table"], w["table_len"],
       w["div_first"], w["div_count"], seed, min(int(round(p * 2 ** 32)), 2 ** 32), V)
    return ids


def accepted(w, slots, out_pos, ids):
    """Drafts a greedy verify of a target that follows the recording accepts: the prefix equal to the recording."""
    rows = w["slot_row"][torch.as_tensor(slots)]
    t = torch.as_tensor(out_pos)
    want = w["table"][rows[:, None], t[:, None] + 1 + torch.arange(ids.shape[1] - 1)].to(torch.int64)
    return (ids[:, 1:] == want).to(torch.int64).cumprod(dim=1).sum(dim=1)


# ------------------------------------------------------------------------------------------------- the profile
def test_profile_switch_parses_and_solves_tau():
    parse = lambda text: settings.Settings.from_env({settings.ORACLE_PROFILE: text}).oracle_profile  # noqa: E731
    assert parse("geometric:0.85,seed:3") == settings.OracleProfile(p=0.85, tau=None, seed=3)
    assert settings.Settings.from_env({}).oracle_profile == settings.OracleProfile(p=0.85, tau=None, seed=0)
    prof = parse("tau:6.5")
    p = prof.keep_probability(16)
    assert settings.oracle_tau(p, 16) == pytest.approx(6.5, abs=1e-9) and 0.85 < p < 0.87
    assert settings.oracle_tau(0.85, 16) == pytest.approx(1 + sum(0.85 ** j for j in range(1, 16)))
    assert "full-block tau 6.500" in prof.describe(16)
    for bad in ("geometric:1.5", "tau:0.5", "geometric:0.8,tau:3", "seed:1", "p:0.8", "geometric:x"):
        with pytest.raises(SettingsError, match="SGLANG_DFLASH_ORACLE_PROFILE.*Fix"):
            parse(bad)
    with pytest.raises(SettingsError, match="outside 1..16"):
        parse("tau:17").keep_probability(16)


def test_full_block_accept_lengths_follow_the_geometric_law():
    p, n_req, length = 0.8, 8, 2000
    w = world(n_prompts=n_req, length=length + B)
    starts = torch.arange(0, length, 7)  # steps starting at many positions of every prompt
    slots = torch.arange(n_req).repeat_interleave(len(starts))
    pos = starts.repeat(n_req)
    ids = step(w, slots, pos, p=p)
    a = accepted(w, slots, pos, ids)
    n = len(a)
    assert a.float().mean().item() == pytest.approx(sum(p ** j for j in range(1, B)), abs=0.12)
    for j in range(1, 6):  # P(accept >= j) = p^j: each position kept with p, independently
        assert (a >= j).float().mean().item() == pytest.approx(p ** j, abs=4 * (p ** j / n) ** 0.5 + 0.01)
    # a miss is the recorded token + 1 (certain to be rejected by a target that follows the recording)
    rows = w["slot_row"][slots]
    rec = w["table"][rows[:, None], pos[:, None] + 1 + torch.arange(B - 1)].to(torch.int64)
    assert bool(((ids[:, 1:] == rec) | (ids[:, 1:] == (rec + 1) % V)).all())
    # the keep events are per position, not per step: two steps covering one position agree on it
    again = step(w, slots, pos + 1, p=p)
    assert torch.equal(again[:, 1:-1] == rec[:, 1:], ids[:, 2:] == rec[:, 1:])


def test_keep_rate_and_seed():
    pos = torch.arange(200_000)
    h = position_hash(0, torch.tensor(12345), pos)
    assert int(h.min()) >= 0 and int(h.max()) < 2 ** 32
    for p in (0.3, 0.85):
        assert (h < int(p * 2 ** 32)).float().mean().item() == pytest.approx(p, abs=0.005)
    other = position_hash(1, torch.tensor(12345), pos)
    assert (h == other).float().mean().item() < 0.001  # another seed, other events
    assert torch.equal(h, position_hash(0, torch.tensor(12345), pos))  # counter-based: the same draw every time


def test_same_events_whatever_the_batch_and_its_order():
    w = world()
    slots, pos = [0, 1, 2, 3, 4, 5], [0, 5, 17, 100, 3, 250]
    together = step(w, slots, pos)
    perm = [4, 2, 0, 5, 1, 3]
    shuffled = step(w, [slots[i] for i in perm], [pos[i] for i in perm])
    assert torch.equal(shuffled, together[perm])
    for i in range(len(slots)):  # alone, and at a narrower width (the first k drafts of the same events)
        assert torch.equal(step(w, [slots[i]], [pos[i]])[0], together[i])
        assert torch.equal(step(w, [slots[i]], [pos[i]], k=3)[0], together[i, :4])


def test_uncovered_positions_keep_the_drafters_drafts():
    w = world(length=50)
    drafts = torch.arange(3 * B, dtype=torch.int64).view(3, B) + 5000
    # slot 8: no recording; slot 0 at position 40: drafts 1..9 covered, 10..15 past the recording's end
    ids = step(w, [8, 0, 1], [0, 40, 10], drafts=drafts, bonus=torch.tensor([7, int(w["table"][7, 40]),
                                                                             int(w["table"][6, 10])]))
    assert torch.equal(ids[0, 1:], drafts[0, 1:])
    assert bool((ids[1, 1:10] < V).all()) and torch.equal(ids[1, 10:], drafts[1, 10:])
    assert bool((ids[2, 1:] < V).all())
    assert int(w["div_count"].sum()) == 0


def test_bonus_divergence_is_counted_with_its_first_position():
    w = world()
    good = w["table"][7, 30].item()
    step(w, [0], [30], bonus=torch.tensor([(good + 1) % V]))
    step(w, [0], [12], bonus=torch.tensor([(w["table"][7, 12].item() + 3) % V]))
    step(w, [0], [40])  # on the recording: not counted
    assert w["div_first"][7].item() == 12 and w["div_count"][7].item() == 2
    assert int(w["div_count"].sum()) == 2


def test_torch_twin_is_capturable():
    w = world()
    calls = []
    step(w, [0, 3, 8], [0, 10, 5], fn=lambda *a: calls.append(a))  # the inputs, built outside the recorder
    ids = calls[0][0].clone()
    assert_capturable(oracle_drafts_torch, *calls[0])  # no .item(), no data-dependent shapes, no host tensors
    assert not torch.equal(ids, calls[0][0])  # it did replace drafts


# ------------------------------------------------------------------------------------------ the Triton kernel
CASES = [("full block", [0, 1, 2, 8], [0, 7, 290, 3], B - 1, 0.8, 0), ("k=3, seed 7", [5, 4], [1, 2], 3, 0.5, 7),
         ("p=1", [0, 1], [3, 4], 7, 1.0, 0), ("p=0", [2, 3], [3, 4], 15, 0.0, 2 ** 32 - 1),
         ("divergent bonus", [0], [10], B - 1, 0.9, 0)]


def _kernel_vs_twin(device: str) -> dict[str, bool]:
    from sglang_dflash.kernels.oracle_drafts import oracle_drafts

    out = {}
    for name, slots, pos, k, p, seed in CASES:
        results = []
        for fn, dev in ((oracle_drafts_torch, "cpu"), (oracle_drafts, device)):
            w = {key: t.to(dev) for key, t in world(length=300).items()}
            bonus = torch.tensor([5] * len(slots)) if name == "divergent bonus" else None
            ids = step({key: t.cpu() for key, t in w.items()}, slots, pos, k=k, p=p, seed=seed, bonus=bonus,
                       fn=lambda *a, **kw: None)  # the inputs only
            ids = ids.to(dev)
            slots_t = torch.tensor(slots, device=dev)
            prefix = w["slot_plen"][slots_t] + torch.tensor(pos, device=dev)
            fn(ids, prefix, slots_t, w["slot_row"], w["slot_plen"], w["slot_key"], w["table"], w["table_len"],
               w["div_first"], w["div_count"], seed, min(int(round(p * 2 ** 32)), 2 ** 32), V)
            results.append((ids.cpu(), w["div_first"].cpu(), w["div_count"].cpu()))
        out[name] = all(torch.equal(a, b) for a, b in zip(*results))
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


def test_interpreted_kernel_equals_torch_twin(interpreted):
    assert len(interpreted) == len(CASES)
    assert_all_equal(interpreted)


@needs_gpu
def test_gpu_kernel_equals_torch_twin():
    assert_all_equal(_kernel_vs_twin("cuda"))


# --------------------------------------------------------------------------------- recording and refusals
def test_record_keeps_the_common_prefix(tmp_path):
    from sglang_dflash.serving.oracle_drafts import load_recording, prompt_key, record

    rows = [{"dataset": "random", "uid": 0, "prompt": [1, 2, 3], "ids": [9, 8, 7, 6]},
            {"dataset": "random", "uid": 0, "prompt": [1, 2, 3], "ids": [9, 8, 5, 5]},  # plain disagreed at 2
            {"dataset": "random", "uid": 1, "prompt": [4, 5], "ids": [1, 2]},
            {"dataset": "random", "uid": 1, "prompt": [4, 5], "ids": [1, 2, 3]}]  # longer, agrees
    src = tmp_path / "none.outputs.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    counts = record(src, tmp_path / "rec.json")
    assert counts == {"prompts": 2, "rows": 4, "cut_where_plain_disagreed": 1, "tokens": 5}
    got = {r["key"]: r for r in load_recording(tmp_path / "rec.json")}
    assert got[prompt_key([1, 2, 3])]["ids"] == [9, 8] and got[prompt_key([4, 5])]["ids"] == [1, 2, 3]
    assert got[prompt_key([4, 5])]["prompt_len"] == 2


def test_warm_compiles_each_width_and_changes_nothing(tmp_path):
    """OracleDrafts.warm runs the launch once per drafted width (the kernel's block size is a compile-time constant)
    on a scratch row, leaving every slot, counter and recording as it was."""
    from sglang_dflash.serving.oracle_drafts import OracleDrafts, record
    from sglang_dflash.settings import ORACLE_PROFILE, _oracle_profile

    src = tmp_path / "none.outputs.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write(json.dumps({"dataset": "random", "uid": 0, "prompt": [1, 2], "ids": [3, 4, 5, 6]}) + "\n")
    record(src, tmp_path / "rec.json")
    oracle = OracleDrafts(str(tmp_path / "rec.json"), _oracle_profile(ORACLE_PROFILE, "tau:6.5,seed:0"), B, V, 4, "cpu")
    oracle.slot_row[0] = 0
    calls = []
    launch = oracle._launch
    oracle._launch = lambda ids, *a: (calls.append(ids.shape[1] - 1), launch(ids, *a))
    oracle.warm([0, 3, 7, 15, 7])
    assert calls == [3, 7, 15]
    assert oracle.slot_row.tolist() == [0, -1, -1, -1] and int(oracle.div_count.sum()) == 0


def test_refused_without_model_like_dummy_weights(tmp_path, monkeypatch):
    from sglang_dflash.serving.oracle_drafts import OracleDraftsError, check_allowed, check_at_launch
    from sglang_dflash.serving.startup import DFlashStartupError

    for fmt, dummy in (("auto", "model"), ("dummy", "sglang"), ("safetensors", "sglang")):
        with pytest.raises(OracleDraftsError, match=r"SGLANG_DFLASH_ORACLE_DRAFTS.*Fix: unset.*--load-format dummy"):
            check_allowed(SimpleNamespace(load_format=fmt), dummy)
    check_allowed(SimpleNamespace(load_format="dummy"), "model")
    check_allowed(SimpleNamespace(load_format="dummy"), "chain")
    assert issubclass(OracleDraftsError, DFlashStartupError)  # a start-up refusal, shown as one
    # the launcher's check: the switches from the environment, the file, the profile against the block
    monkeypatch.setenv(settings.ORACLE_DRAFTS, str(tmp_path / "missing.json"))
    monkeypatch.setenv(settings.DUMMY_WEIGHTS, "model")
    with pytest.raises(OracleDraftsError, match="no such file.*Fix: record one"):
        check_at_launch(SimpleNamespace(load_format="dummy"), 16)
    monkeypatch.setenv(settings.DUMMY_WEIGHTS, "sglang")
    with pytest.raises(OracleDraftsError, match="--load-format dummy"):
        check_at_launch(SimpleNamespace(load_format="dummy"), 16)
    monkeypatch.delenv(settings.ORACLE_DRAFTS)
    check_at_launch(SimpleNamespace(load_format="auto"), 16)  # off: nothing checked


def test_builtin_worker_refuses_oracle_drafts(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.plugins import hook_registry

    from sglang_dflash.serving import plugin
    from sglang_dflash.serving.startup import DFlashStartupError

    class Registry:
        def __init__(self):
            self.hooks = {}

        def register(self, target, fn, kind):
            self.hooks[target] = fn

    registry = Registry()
    monkeypatch.setattr(hook_registry, "HookRegistry", registry)
    monkeypatch.setenv(plugin.WORKER_ENV, "builtin")
    monkeypatch.setenv(settings.ORACLE_DRAFTS, "/tmp/rec.json")
    monkeypatch.delenv(settings.DUMMY_WEIGHTS, raising=False)
    plugin.register()
    with pytest.raises(DFlashStartupError, match="builtin.*Fix: unset SGLANG_DFLASH_ORACLE_DRAFTS"):
        registry.hooks[f"{plugin._HOOK_ARGS}._handle_dflash"](lambda args: None, object())


def test_driver_oracle_methods():
    from benchmarks import driver

    assert driver.method_variant("ours-oracle") == ("ours", {settings.ORACLE_DRAFTS: driver.ORACLE_RECORDING})
    assert driver.method_variant("ours-fixed-oracle") == ("ours", {settings.ADAPTIVE: "0",
                                                                   settings.ORACLE_DRAFTS: driver.ORACLE_RECORDING})
    with pytest.raises(SystemExit):
        driver.method_variant("builtin-oracle")
    with pytest.raises(SystemExit):
        driver.method_variant("none-oracle")



def test_driver_records_from_the_plain_run_and_sets_the_switches(tmp_path, monkeypatch):
    from benchmarks import driver

    args = driver.parser().parse_args(["--target", "t", "--draft", "d", "--out", str(tmp_path), "--dummy"])
    with pytest.raises(driver.NoRecording, match="run `none` first"):
        driver.server_env(args, "ours-oracle")
    with gzip.open(tmp_path / "none.outputs.jsonl.gz", "wt") as f:
        f.write(json.dumps({"dataset": "random", "uid": 0, "prompt": [3, 4], "ids": [5, 6, 7]}) + "\n")
    monkeypatch.setenv(settings.ORACLE_DRAFTS, "/elsewhere.json")  # never inherited by a server
    env = driver.server_env(args, "ours-fixed-oracle")
    assert env[settings.ORACLE_DRAFTS] == str(tmp_path / "oracle-recording.json")
    assert env[settings.ORACLE_PROFILE] == "tau:6.5,seed:0" and env[settings.ADAPTIVE] == "0"
    assert env[settings.DUMMY_WEIGHTS] == "chain"  # the driver's default
    for method in ("none", "ours", "builtin"):
        assert settings.ORACLE_DRAFTS not in driver.server_env(args, method)
    model = driver.parser().parse_args(["--target", "t", "--draft", "d", "--out", str(tmp_path), "--dummy", "--dummy-weights", "model"])
    assert driver.server_env(model, "none")[settings.DUMMY_WEIGHTS] == "model"
    own = driver.parser().parse_args(["--target", "t", "--draft", "d", "--out", str(tmp_path), "--dummy", "--sglang-dummy-weights"])
    assert settings.DUMMY_WEIGHTS not in driver.server_env(own, "none") or \
        driver.server_env(own, "none")[settings.DUMMY_WEIGHTS] == os.environ.get(settings.DUMMY_WEIGHTS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    print_interpreted(_kernel_vs_twin)
