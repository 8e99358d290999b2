"""A hybrid target's Gated DeltaNet state through verify + commit steps, with SGLang's kernels and our commit
(serving/recurrent_state.py), against the state after running only the accepted tokens. The body of
tests/test_recurrent_state.py's replay tests: under Triton's interpreter on CPU (`python FILE --interpret`, a
subprocess, since TRITON_INTERPRET must be set before triton is imported), or natively on a CUDA GPU.

Per step, with every request at its own mamba slot:
  verify   SGLang's GDN verify kernel (fused_sigmoid_gating_delta_rule_update) over W = k + 1 tokens per request,
           the persistent state untouched, in one of two modes, as the GDN backend runs it:
             replay    cache_ring=True: each token's raw k, v, gate, beta into the slot's window
                       (--enable-linear-replayssm-spec; SGLang 0.5.17's fold-every-commit protocol)
             snapshot  the state after every token into per-request step caches (SGLang's default)
             in place  (SGLANG_DFLASH_K0_STATE_IN_PLACE=1, replay pool) through our hook on the GDN extend forward
                       (verify_one_token_as_decode): at one token per request SGLang's decode kernels (conv update
                       and packed recurrent decode) advance the conv window and the state in place; at more tokens
                       the replay verify
           plus the conv window after every token (random here: the conv kernel is not under test, except at an
           in-place k = 0 step, which runs it)
  accept   commit_len in 1..W per request (random)
  commit   RecurrentStateCommit.after_accept(..., width=W): the replay pool -> SGLang's fold
           (commit_gdn_replayssm_fold_after_verify: GDN kernel) with a chain's step indices; the snapshot pool ->
           the backend's scatter
  check    every request's state (all layers) == the state after running ONLY its committed tokens from the
           previous committed state (the same kernel, state update on, ragged lengths); conv state == the window at
           commit_len - 1; a radix track slot (extra_buffer) == the state after the boundary step; other slots
           untouched. An in-place k = 0 step is held to plain decoding of its token (SGLang's decode kernels on the
           committed state, bit for bit), and that to the verify kernel's state for the same token (`decode_vs_extend`:
           rounding only, the two kernels' sums run in another order).

Widths cycle through k = 15, 0, 3, 7 (the adaptive policy's widths at a block of 16; k = 0 is a plain step).
Mutations of the commit must make the check fail (the test's planted bugs): committing all W verified tokens,
one token short, into the request-pool index instead of the mamba slot, the snapshot scatter on a replay pool, the
fold after an in-place k = 0 verify (the token twice), or no fold after a k = 0 verify that did not run in place
(the token lost).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":  # the child: the worktree's package, not another install's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from sglang_dflash.settings import K0_STATE_IN_PLACE  # noqa: E402

LAYERS, H, HV, KD, VD = 2, 1, 2, 16, 16  # GDN layers, k heads, v heads, k dim, v dim
SLOTS = 8  # mamba pool slots (incl. SGLang's padding slot)
RECORD = 16  # the window: SGLang sizes it to the draft maximum (--speculative-num-draft-tokens = the block)
QKV = 2 * H * KD + HV * VD  # the packed projection a GDN layer's conv runs over
CONV_DIM, CONV_W = QKV, 3  # conv channels, window (kernel - 1)
WIDTHS = (16, 1, 4, 8)  # k = 15, 0, 3, 7
SLOT_OF_REQ = torch.tensor([5, 1, 3])  # req_pool_indices 0, 1, 2 -> mamba slots
TRACK_SLOTS = torch.tensor([6, 2, 7])  # radix snapshot slots (extra_buffer), one per request
INTERVAL = 5  # mamba_track_interval of the track case


class ForwardMode:
    @staticmethod
    def is_idle():
        return False


def _inputs(g, bs, w, device):
    """One layer's verify inputs for bs requests x w tokens (SGLang's GDN layout: [1, tokens, heads, dim])."""
    n = bs * w

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    return dict(q=r(1, n, H, KD), k=r(1, n, H, KD), v=r(1, n, HV, VD), a=r(n, HV), b=r(n, HV))


def _gdn(layer_params, x, state, indices, cu, **kw):
    from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update

    return fused_sigmoid_gating_delta_rule_update(
        A_log=layer_params["A_log"], dt_bias=layer_params["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=x["a"],
        b=x["b"], initial_state_source=state, initial_state_indices=indices, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, **kw)


def _packed_inputs(g, bs, device):
    """One layer's inputs at one token per request as the GDN layer hands them to its backend: the packed projection
    before the conv, and the gates."""
    return dict(mixed_qkv=torch.randn(bs, QKV, generator=g).to(device), a=torch.randn(bs, HV, generator=g).to(device),
                b=torch.randn(bs, HV, generator=g).to(device))


def _gdn_layer(layer_params, layer_id):
    return SimpleNamespace(layer_id=layer_id, activation="silu", head_k_dim=KD, head_q_dim=KD, num_q_heads=H,
                           num_k_heads=H, num_v_heads=HV, head_v_dim=VD, q_dim=H * KD, k_dim=H * KD, v_dim=HV * VD,
                           **layer_params)


def _extend_through_hook(spec, pool, slots, layer_params, layer_id, w, packed, original):
    """GDNAttnBackend.forward_extend for a TARGET_VERIFY of w tokens per request, as the hybrid backend calls it
    (keywords), with our AROUND hook in front: a backend stand-in with the pool's per-layer caches and SGLang's Triton
    GDN kernels."""
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    from sglang_dflash.serving.recurrent_state import verify_one_token_as_decode

    caches = [SimpleNamespace(conv=[spec.conv[0][i]], temporal=spec.temporal[i]) for i in range(LAYERS)]
    kernel = TritonGDNKernel()
    backend = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(mamba_pool=pool.mamba_pool, mamba2_layer_cache=lambda i: caches[i]),
        forward_metadata=SimpleNamespace(mamba_cache_indices=slots.to(torch.int32),
                                         query_start_loc=torch.arange(slots.numel() + 1, dtype=torch.int32,
                                                                      device=slots.device)),
        kernel_dispatcher=SimpleNamespace(supports_packed_decode=_packed_decode(slots.device),
                                          packed_decode=kernel.packed_decode, decode=kernel.decode))
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True),
                            spec_info=SimpleNamespace(draft_token_num=w))
    packed = packed or {"mixed_qkv": None, "a": None, "b": None}
    return verify_one_token_as_decode(original, backend, q=None, k=None, v=None, layer=_gdn_layer(layer_params, layer_id),
                                      forward_batch=batch, save_kv_cache=True, **packed)


def _decode_reference(layer_params, packed, conv_state, state, slots):
    """Plain decoding of one token per request (GDNAttnBackend.forward_decode's kernels) on the reference's conv
    windows and states, in place: returns the conv output and the layer's output."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    idx, bs = slots.to(torch.int32), slots.numel()
    x = causal_conv1d_update(packed["mixed_qkv"].clone(), conv_state, layer_params["conv_weights"],
                             layer_params["bias"], "silu", conv_state_indices=idx)
    kernel = TritonGDNKernel()
    if _packed_decode(slots.device):
        out = kernel.packed_decode(x, packed["a"], packed["b"], A_log=layer_params["A_log"],
                                   dt_bias=layer_params["dt_bias"], scale=KD ** -0.5, ssm_states=state,
                                   cache_indices=idx, num_v_heads=HV, head_v_dim=VD)
        return x, out
    q, k, v = torch.split(x, [H * KD, H * KD, HV * VD], dim=-1)
    out = kernel.decode(q.reshape(1, bs, H, KD), k.reshape(1, bs, H, KD), v.reshape(1, bs, HV, VD), packed["a"],
                        packed["b"], A_log=layer_params["A_log"], dt_bias=layer_params["dt_bias"], ssm_states=state,
                        cache_indices=idx, query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=slots.device))
    return x, out


def _packed_decode(device: torch.device) -> bool:
    """SGLang's packed decode kernel where it runs (CUDA; under Triton's interpreter it fails on a helper that is not
    jitted), else its other decode path: the dispatcher's choice, both branches of decode_one_token."""
    return device.type == "cuda"


def _accepted(x, bs, w, commit_lens):
    """The rows of x for each request's first commit_lens tokens, and their cu_seqlens (ragged)."""
    keep = (torch.arange(w)[None, :] < commit_lens[:, None].cpu()).reshape(-1).to(x["q"].device)
    out = {"q": x["q"][:, keep], "k": x["k"][:, keep], "v": x["v"][:, keep], "a": x["a"][keep], "b": x["b"][keep]}
    cu = torch.zeros(bs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(commit_lens.cpu(), 0)
    return out, cu.to(x["q"].device)


def _conv_scatter_torch(dst, src, dst_indices, steps):
    """SGLang's fused_conv_window_scatter_with_mask (CUDA only) in torch, for the CPU run: dst[:, dst_indices[i]] :=
    src[:, i, steps[i]] where steps[i] >= 0 (the verify's conv windows are kept per batch row)."""
    for i, (slot, step) in enumerate(zip(dst_indices.tolist(), steps.tolist())):
        if slot >= 0 and step >= 0:
            dst[:, slot] = src[:, i, step]


class _LoopIndex(int):
    """A loop index under Triton's interpreter: a Python int there, a tensor when compiled. SGLang's fold kernel casts
    its loop index (`t.to(tl.int64)`), which the interpreter's int cannot; this int can (the cast of an index is the
    index)."""

    def to(self, *_, **__):
        return self


def _interpreter_range(*args):
    return (_LoopIndex(i) for i in range(*(int(a) for a in args)))


def interpreter_shims() -> None:
    """Under TRITON_INTERPRET=1 only: the fold kernel's loop index gets `.to` (_LoopIndex). The kernel's arithmetic
    is untouched."""
    import sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold as fold

    fold.range = _interpreter_range


def simulate(device: str, replay: bool, track: bool = False, mutation: str | None = None, steps: int = 4,
             seed: int = 0, in_place: bool = False) -> dict:
    import sglang.srt.configs.hybrid_arch as arch
    import sglang.srt.runtime_context as runtime_context
    import sglang.srt.speculative.spec_utils as spec_utils

    from sglang_dflash.serving.recurrent_state import RecurrentStateCommit

    g = torch.Generator().manual_seed(seed)
    bs = SLOT_OF_REQ.numel()
    params = [{"A_log": torch.randn(HV, generator=g).to(device), "dt_bias": torch.randn(HV, generator=g).to(device),
               "conv_weights": torch.randn(QKV, CONV_W + 1, generator=g).to(device) / 2,
               "bias": torch.randn(QKV, generator=g).to(device) / 4} for _ in range(LAYERS)]
    temporal = torch.randn(LAYERS, SLOTS, HV, VD, KD, generator=g).to(device)
    conv = torch.randn(LAYERS, SLOTS, CONV_DIM, CONV_W, generator=g).to(device)
    conv_window = torch.zeros(LAYERS, bs, RECORD, CONV_DIM, CONV_W, device=device)  # per batch row, per step
    spec = SimpleNamespace(
        temporal=temporal, conv=[conv], intermediate_conv_window=[conv_window],
        replayssm_rawv=torch.zeros(LAYERS, SLOTS, HV, RECORD, VD, device=device),
        replayssm_rawk=torch.zeros(LAYERS, SLOTS, H, RECORD, KD, device=device),
        replayssm_g=torch.zeros(LAYERS, SLOTS, HV, RECORD, device=device),
        replayssm_beta=torch.zeros(LAYERS, SLOTS, HV, RECORD, device=device))
    mapping = SLOT_OF_REQ.to(device)
    if mutation == "slots":  # the commit replays into the request-pool index instead of the request's mamba slot
        mapping = torch.arange(bs, device=device)
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(enable_linear_replayssm_spec=replay, replayssm_spec_fold=replay,
                                   replayssm_is_kda=False),
        get_speculative_mamba2_params_all_layers=lambda: spec, get_mamba_indices=lambda req: mapping[req.long()])
    snapshots = torch.zeros(LAYERS, bs, RECORD, HV, VD, KD, device=device)  # the snapshot path's step caches
    slots = SLOT_OF_REQ.to(device)

    class SnapshotBackend:  # the hybrid backend's scatter (update_mamba_state_after_mtp_verify), in torch
        def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                                mamba_steps_to_track, model, **_):
            rows = torch.arange(bs, device=device)
            temporal[:, slots] = snapshots[:, rows, last_correct_step_indices]
            _conv_scatter_torch(conv, conv_window, slots, last_correct_step_indices)
            if mamba_track_indices is not None:
                for i, (dst, step) in enumerate(zip(mamba_track_indices.tolist(), mamba_steps_to_track.tolist())):
                    if step >= 0:
                        temporal[:, dst] = snapshots[:, i, step]
                _conv_scatter_torch(conv, conv_window, mamba_track_indices, mamba_steps_to_track)

    runner = SimpleNamespace(model_config=None, model="target", req_to_token_pool=pool, attn_backend=SnapshotBackend())
    saved = arch.mambaish_config, spec_utils.mambaish_config, spec_utils.get_exec, runtime_context.get_exec
    arch.mambaish_config = spec_utils.mambaish_config = lambda mc: object()
    exec_cfg = SimpleNamespace(mamba=SimpleNamespace(mamba_track_interval=INTERVAL))
    spec_utils.get_exec = runtime_context.get_exec = lambda: exec_cfg
    import sglang.kernels.ops.mamba.mamba_state_scatter_triton as scatter

    saved_scatter = scatter.fused_conv_window_scatter_with_mask
    if device == "cpu":
        scatter.fused_conv_window_scatter_with_mask = _conv_scatter_torch
    import sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold as fold

    saved_fold = fold.commit_gdn_replayssm_fold_after_verify
    width_now = [0]
    if mutation in ("all_verified", "one_short"):  # the fold told the wrong counts
        def mutated(*, accept_lens, **kw):  # noqa: ANN001
            wrong = torch.full_like(accept_lens, width_now[0]) if mutation == "all_verified" else accept_lens - 1
            return saved_fold(accept_lens=wrong, **kw)

        fold.commit_gdn_replayssm_fold_after_verify = mutated
    saved_env = os.environ.get(K0_STATE_IN_PLACE)
    os.environ[K0_STATE_IN_PLACE] = "1" if in_place else "0"
    try:
        commit = RecurrentStateCommit(runner)
        assert commit.active and commit.replay == replay and commit.in_place == in_place
        if mutation == "fold_after_in_place":  # the verify updated the state in place, the commit folds it again
            commit.in_place = False
        if mutation == "scatter":  # the pool has no snapshots, but the commit scatters them anyway
            commit.replay = False
        ref_temporal, ref_conv = temporal.clone(), conv.clone()
        others = [s for s in range(SLOTS) if s not in SLOT_OF_REQ.tolist() + (TRACK_SLOTS.tolist() if track else [])]
        prefix = torch.tensor([3, 9, 14], dtype=torch.int64, device=device)  # committed lengths
        ok, max_err, tracked, tracked_k0, decode_vs_extend = True, 0.0, 0, 0, 0.0
        for step in range(steps):
            w = width_now[0] = WIDTHS[step % len(WIDTHS)]
            commit_lens = torch.randint(1, w + 1, (bs,), generator=g).to(torch.int32)
            if step == 0 and w > 1:
                commit_lens[0] = w  # every draft accepted, once
            inputs = [_inputs(g, bs, w, device) for _ in range(LAYERS)]
            cu = torch.arange(0, bs * w + 1, w, dtype=torch.int32, device=device)
            conv_window.zero_()
            conv_window[:, :, :w] = torch.randn(LAYERS, bs, w, CONV_DIM, CONV_W, generator=g).to(device)
            rows = torch.arange(bs, device=device)
            hooked = in_place and w == 1 and mutation != "no_hook"
            if in_place and w == 1:  # SGLang's decode kernels through our hook: conv window and state in place
                packed = [_packed_inputs(g, bs, device) for _ in range(LAYERS)]
                outs = [_extend_through_hook(spec, pool, slots, params[i], i, w, packed[i], original=None)
                        if hooked else torch.zeros(1, device=device) for i in range(LAYERS)]
            for layer in range(0 if hooked else LAYERS):  # the verify: the persistent state is not touched
                def ring_verify(*_, i=layer, **__):
                    return _gdn(params[i], inputs[i], temporal[i], slots, cu, disable_state_update=True,
                                cache_ring=True, replayssm_rawv=spec.replayssm_rawv[i],
                                replayssm_rawk=spec.replayssm_rawk[i], replayssm_g=spec.replayssm_g[i],
                                replayssm_beta=spec.replayssm_beta[i])

                if in_place and w > 1:  # the hook hands a wider verify to SGLang's forward (the replay verify)
                    _extend_through_hook(spec, pool, slots, params[layer], layer, w, None, original=ring_verify)
                elif replay:
                    ring_verify()
                else:
                    _gdn(params[layer], inputs[layer], temporal[layer], slots, cu, disable_state_update=True,
                         intermediate_states_buffer=snapshots[layer], intermediate_state_indices=rows.to(torch.int32),
                         cache_steps=RECORD)
            before = temporal.clone()
            batch = SimpleNamespace(forward_mode=ForwardMode(), req_pool_indices=torch.arange(bs, device=device),
                                    seq_lens=prefix, mamba_track_indices=TRACK_SLOTS.to(device) if track else None)
            commit.after_accept(runner.attn_backend, batch, prefix, commit_lens.to(device), w)

            # the reference: only the committed tokens, from the previous committed state, state update on
            per_step = torch.zeros(LAYERS, bs, RECORD, HV, VD, KD, device=device)
            in_place_step = in_place and w == 1
            for layer in range(LAYERS):
                if in_place_step:  # plain decoding of the one token: SGLang's decode kernels on the committed state
                    extend_state = ref_temporal[layer].clone()
                    x, want = _decode_reference(params[layer], packed[layer], ref_conv[layer], ref_temporal[layer],
                                                slots)
                    per_step[layer, :, 0] = ref_temporal[layer][slots]
                    ok = ok and torch.equal(outs[layer], want)
                    q, k, v = torch.split(x, [H * KD, H * KD, HV * VD], dim=-1)
                    one = dict(q=q.reshape(1, bs, H, KD), k=k.reshape(1, bs, H, KD), v=v.reshape(1, bs, HV, VD),
                               a=packed[layer]["a"], b=packed[layer]["b"])
                    _gdn(params[layer], one, extend_state, slots, cu)  # the verify kernel's state for that token
                    decode_vs_extend = max(decode_vs_extend, (extend_state - ref_temporal[layer]).abs().max().item())
                    continue
                kept, kept_cu = _accepted(inputs[layer], bs, w, commit_lens)
                _gdn(params[layer], kept, ref_temporal[layer], slots, kept_cu,
                     intermediate_states_buffer=per_step[layer], intermediate_state_indices=rows.to(torch.int32),
                     cache_steps=RECORD)
            if not in_place_step:
                ref_conv[:, slots] = conv_window[:, rows, commit_lens.long().to(device) - 1]
            checks = [(temporal[:, slots], ref_temporal[:, slots]), (conv[:, slots], ref_conv[:, slots]),
                      (temporal[:, others], before[:, others])]
            if track:
                from sglang_dflash.serving.recurrent_state import boundary_steps

                crossing = boundary_steps(prefix, commit_lens.to(device), INTERVAL)
                for i, s in enumerate(crossing.tolist()):
                    if s >= 0:  # the state after the boundary step: a step of the committed-only run
                        tracked += 1
                        tracked_k0 += w == 1
                        checks.append((temporal[:, TRACK_SLOTS[i]], per_step[:, i, s]))
                        window = ref_conv[:, slots[i]] if in_place_step else conv_window[:, i, s]
                        checks.append((conv[:, TRACK_SLOTS[i]], window))
            for got, want in checks:
                max_err = max(max_err, (got.float() - want.float()).abs().max().item() if got.numel() else 0.0)
                ok = ok and torch.equal(got, want)
            prefix = prefix + commit_lens.to(device)
        ok = ok and decode_vs_extend < 1e-4
        return {"equal": bool(ok), "max_err": max_err, "tracked": tracked, "tracked_k0": tracked_k0,
                "decode_vs_extend": decode_vs_extend}
    finally:
        if saved_env is None:
            os.environ.pop(K0_STATE_IN_PLACE, None)
        else:
            os.environ[K0_STATE_IN_PLACE] = saved_env
        arch.mambaish_config, spec_utils.mambaish_config, spec_utils.get_exec, runtime_context.get_exec = saved
        scatter.fused_conv_window_scatter_with_mask = saved_scatter
        fold.commit_gdn_replayssm_fold_after_verify = saved_fold


CASES = {
    "replay": dict(replay=True),
    "replay_track": dict(replay=True, track=True),
    "snapshot": dict(replay=False),
    "snapshot_track": dict(replay=False, track=True),
    "bug_all_verified": dict(replay=True, mutation="all_verified", steps=1),
    "bug_one_short": dict(replay=True, mutation="one_short", steps=2),
    "bug_slots": dict(replay=True, mutation="slots", steps=1),
    "bug_snapshot_scatter_on_replay_pool": dict(replay=True, mutation="scatter", steps=1),
    "in_place": dict(replay=True, in_place=True, steps=2),  # k = 15 (the replay verify through the hook), then k = 0
    "in_place_track": dict(replay=True, in_place=True, track=True, steps=2),  # request 0: 19 -> 20 at k = 0
    "bug_fold_after_in_place": dict(replay=True, in_place=True, mutation="fold_after_in_place", steps=2),
    # the commit skips the fold although the k = 0 verify did not run in place (the hook missing): the token is lost
    "bug_in_place_commit_without_hook": dict(replay=True, in_place=True, mutation="no_hook", steps=2),
}


def run_cases(device: str) -> dict:
    return {name: simulate(device, **kw) for name, kw in CASES.items()}


if __name__ == "__main__":
    import json
    import time

    assert os.environ.get("TRITON_INTERPRET") == "1" or "--cuda" in sys.argv
    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_shims()
    t0 = time.time()
    out = run_cases("cuda" if "--cuda" in sys.argv else "cpu")
    out["seconds"] = time.time() - t0
    print(json.dumps(out))
