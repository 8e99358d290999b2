"""The decode step's fused kernels (``sglang_dflash.kernels.greedy_accept`` / ``block_inputs``) == their torch twins.

The Triton kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before triton is first
imported); on CUDA natively too. Greedy accept: every accepted length 0..W-1 (all drafts rejected, some, all), widths
1..32 (non-powers of two; 1 is a plain step, no drafts), drafts read as a column slice of the verify ids (stride W),
int32 / int64 committed lengths; its twin equals the foundation's rule (``acceptance.verify_greedy``). Block inputs: int32 req_to_token rows
in a permuted order, int32 / int64 lengths, block sizes 1..16 (1: the k = 0 step), verify ids of another width.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _interpreter import assert_all_equal, needs_gpu, print_interpreted, run_interpreted

from sglang_dflash.acceptance import verify_greedy
from sglang_dflash.kernels.greedy_accept import greedy_accept_torch

NAMES = ("commit_lens", "tokens", "next_ids", "bonus", "accept_lens", "new_lens")


def make_case(bs: int, width: int, prefix_dtype: torch.dtype, seed: int, device: str = "cpu"):
    """Verify ids [bs, W] (bonus + drafts) and the target's argmax ids, request r agreeing on its first
    r % W drafts, so every accepted length appears."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 50_000, (bs, width), generator=g)
    verify_ids = torch.randint(0, 50_000, (bs, width), generator=g)
    for r in range(bs):
        agree = r % width
        verify_ids[r, 1:agree + 1] = target[r, :agree]
        if agree < width - 1:
            verify_ids[r, agree + 1] = target[r, agree] + 1  # the first rejected draft differs for sure
    prefix = torch.randint(1, 4000, (bs,), generator=g).to(prefix_dtype)
    return target.to(device), verify_ids.to(device), prefix.to(device)


CASES = [(bs, w, dt) for bs, w in ((1, 2), (3, 4), (17, 16), (40, 8), (33, 32), (5, 13), (1, 1), (6, 1))
         for dt in (torch.int64, torch.int32)]  # W = 1: a plain (k = 0) step


def block_case(bs: int, B: int, W: int, dt: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    rows, max_len = bs + 3, 64
    req_to_token = torch.randperm(rows * max_len, generator=g).to(torch.int32).view(rows, max_len)
    args = dict(bonus=torch.randint(5, 1000, (bs,), generator=g), prefix=torch.randint(0, max_len - B, (bs,),
                generator=g).to(dt), pool_rows=torch.randperm(rows, generator=g)[:bs].to(dt),
                req_to_token=req_to_token, mask_id=3)
    outs = dict(block_ids=torch.full((bs, B), -7), positions=torch.full((bs, B), -7), cache_loc=torch.full((bs, B), -7),
                verify_ids=torch.full((bs, W), -7))
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in args.items()}, \
        {k: v.to(device) for k, v in outs.items()}


BLOCK_CASES = [(1, 16, 16, torch.int64), (5, 16, 8, torch.int32), (9, 4, 2, torch.int64), (3, 13, 13, torch.int32),
               (4, 1, 1, torch.int64)]  # B = 1: the k = 0 step's inputs

# verify metadata: (bs, W, length dtype, mask pointers): over 128 requests (several prefix-sum iterations), rows over
# 512 slots (several copy iterations), zero-length padded rows, W = 1
# window: None, or (sliding window size, whether the pool maps full slots to its own window slots); a window of 600
# over rows of up to 700 slots crosses the copy loop's 512-slot iterations and leaves short rows whole
META_CASES = [(1, 16, torch.int64, True, None), (130, 16, torch.int32, False, None), (7, 5, torch.int64, True, None),
              (3, 1, torch.int32, True, None), (9, 16, torch.int64, True, (600, True)),
              (130, 8, torch.int32, True, (127, False)), (4, 1, torch.int64, True, (1, True))]


def metadata_case(bs: int, W: int, dt: torch.dtype, mask: bool, window, seed: int, device: str = "cpu"):
    """(inputs, output buffers) of verify_metadata: SGLang's buffer dtypes (qo / mask int64, kv_indptr int32; window
    indptr / offsets int32, indices int64)."""
    from sglang_dflash.kernels.verify_metadata import Window

    g = torch.Generator().manual_seed(seed)
    rows, max_len = bs + 3, 700
    req_to_token = torch.randperm(rows * max_len, generator=g).to(torch.int32).view(rows, max_len)
    seq_lens = torch.randint(0, max_len, (bs,), generator=g)
    seq_lens[bs // 2] = 0  # a padded graph row attends nothing
    args = dict(seq_lens=seq_lens.to(dt), pool_rows=torch.randperm(rows, generator=g)[:bs].to(dt),
                req_to_token=req_to_token, width=W)
    outs = dict(qo_indptr=torch.full((bs + 4,), -7), kv_indptr=torch.full((bs + 4,), -7, dtype=torch.int32),
                kv_indices=torch.full((int(seq_lens.sum()) + 9,), -7),
                mask_indptr=torch.full((bs + 4,), -7) if mask else None)
    move = lambda t: t.to(device) if torch.is_tensor(t) else t  # noqa: E731
    args, outs = {k: move(v) for k, v in args.items()}, {k: move(v) for k, v in outs.items()}
    if window is not None:
        size, mapped = window
        swa_map = torch.randperm(rows * max_len + 1, generator=g) if mapped else None
        outs["window"] = Window(size, move(torch.full((bs + 4,), -7, dtype=torch.int32)),
                                move(torch.full((bs * size + 9,), -7)),
                                move(torch.full((bs + 2,), -7, dtype=torch.int32)), move(swa_map))
    return args, outs


def _same_outputs(got: dict, want: dict) -> bool:
    def same(a, b):
        return (a is None and b is None) or (torch.is_tensor(a) and a.dtype == b.dtype and torch.equal(a, b))

    window = [(getattr(got.get("window"), f), getattr(want.get("window"), f))
              for f in ("indptr", "indices", "offsets")] if got.get("window") is not None else []
    return all(same(got[k], want[k]) for k in got if k != "window") and all(same(a, b) for a, b in window)


def _hook_vs_sglang(device: str) -> dict[str, bool]:
    """Our hook and SGLang 0.5.17's ``TritonAttnBackend._update_target_verify_buffers`` on the same backend state:
    the same return values and the same buffers (SGLang's index-copy kernel is Triton too, hence the interpreter)."""
    import types

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from sglang_dflash.serving.verify_metadata import update_target_verify_buffers

    class SWAKVPool:  # SGLang's pool class is recognised by name; its translation is a mapping look-up
        def __init__(self, mapping):
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            return self.full_to_swa_index_mapping[kv_indices]

    out = {}
    cases = ((1, 16, None), (9, 16, None), (4, 8, None), (9, 16, (100, False)), (5, 8, (37, True)), (3, 1, (64, True)))
    for i, (bs, W, window) in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)
        req_to_token = torch.randperm(12 * 300, generator=g).to(torch.int32).view(12, 300).to(device)
        seq_lens = torch.randint(1, 300, (bs,), generator=g).to(device)
        pool_rows = torch.randperm(12, generator=g)[:bs].to(device)
        spec = DFlashVerifyInput(draft_token=torch.zeros(bs * W, dtype=torch.int64, device=device),
                                 positions=torch.zeros(bs * W, dtype=torch.int64, device=device), draft_token_num=W)

        size, mapped = window or (None, False)
        pool = SWAKVPool(torch.randperm(12 * 300 + 1, generator=g).to(device)) if mapped else None

        def backend():
            ns = types.SimpleNamespace(
                num_draft_tokens=16, device=device, req_to_token=req_to_token, sliding_window_size=size,
                _verify_mask=None, token_to_kv_pool=pool, _translate_kv_loc=None,
                window_kv_indptr=torch.zeros(17, dtype=torch.int32, device=device),
                qo_indptr=torch.zeros(17, dtype=torch.int64, device=device),
                kv_indptr=torch.zeros(17, dtype=torch.int32, device=device),
                mask_indptr=torch.zeros(17, dtype=torch.int64, device=device),
                cuda_graph_kv_indices=torch.zeros(16 * 300, dtype=torch.int64, device=device),
                cuda_graph_window_kv_indices=torch.zeros(16 * 300, dtype=torch.int64, device=device),
                cuda_graph_window_num_kv_splits=torch.full((16,), 8, dtype=torch.int32, device=device),
                cuda_graph_window_kv_offsets=torch.zeros(16, dtype=torch.int32, device=device))
            ns._fill_kv_indptr_and_indices = types.MethodType(TritonAttnBackend._fill_kv_indptr_and_indices, ns)
            return ns

        theirs, ours = backend(), backend()
        want = TritonAttnBackend._update_target_verify_buffers(theirs, bs, seq_lens, pool_rows, spec)
        got = update_target_verify_buffers(TritonAttnBackend._update_target_verify_buffers, ours, bs, seq_lens,
                                           pool_rows, spec)
        same = len(got) == len(want) and all(
            (a is None and b is None) or (torch.is_tensor(a) and a.dtype == b.dtype and torch.equal(a, b))
            for a, b in zip(got, want))
        bufs = ("qo_indptr", "kv_indptr", "mask_indptr", "cuda_graph_kv_indices", "window_kv_indptr",
                "cuda_graph_window_kv_indices", "cuda_graph_window_kv_offsets")
        out[f"hook {bs}x{W}/window={window}"] = same and all(
            torch.equal(getattr(ours, k), getattr(theirs, k)) for k in bufs)
    return out


def _kernel_vs_twin(device: str) -> dict[str, bool]:
    from sglang_dflash.kernels.block_inputs import block_inputs, block_inputs_torch
    from sglang_dflash.kernels.greedy_accept import greedy_accept
    from sglang_dflash.kernels.verify_metadata import verify_metadata, verify_metadata_torch

    out = {}
    for i, (bs, w, dt) in enumerate(CASES):
        target, verify_ids, prefix = make_case(bs, w, dt, seed=i, device=device)
        got = greedy_accept(target, verify_ids[:, 1:], prefix)
        want = greedy_accept_torch(target, verify_ids[:, 1:], prefix)
        out[f"accept {bs}x{w}/{dt}"] = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    for i, (bs, B, W, dt) in enumerate(BLOCK_CASES):
        args, got = block_case(bs, B, W, dt, seed=i, device=device)
        _, want = block_case(bs, B, W, dt, seed=i, device=device)
        block_inputs(**args, **got)
        block_inputs_torch(**args, **want)
        out[f"block {bs}x{B}/W{W}/{dt}"] = all(torch.equal(got[k], want[k]) for k in got)
    for i, (bs, W, dt, mask, window) in enumerate(META_CASES):
        args, got = metadata_case(bs, W, dt, mask, window, seed=i, device=device)
        _, want = metadata_case(bs, W, dt, mask, window, seed=i, device=device)
        verify_metadata(**args, **got)
        verify_metadata_torch(**args, **want)
        out[f"metadata {bs}x{W}/{dt}/mask={mask}/window={window}"] = _same_outputs(got, want)
    out.update(_hook_vs_sglang(device))
    return out


def test_block_inputs_torch_twin():
    from sglang_dflash.kernels.block_inputs import block_inputs_torch

    args, out = block_case(5, 16, 8, torch.int32, seed=1)
    block_inputs_torch(**args, **out)
    p, rows = args["prefix"].long(), args["pool_rows"].long()
    assert torch.equal(out["positions"], p[:, None] + torch.arange(16))
    want_slots = torch.stack([args["req_to_token"][r, q:q + 16] for r, q in zip(rows, p)]).long()
    assert torch.equal(out["cache_loc"], want_slots)
    assert out["block_ids"][:, 0].tolist() == args["bonus"].tolist() and (out["block_ids"][:, 1:] == 3).all()
    assert torch.equal(out["verify_ids"][:, 0], args["bonus"]) and (out["verify_ids"][:, 1:] == -7).all()


def test_torch_twin_is_the_foundations_rule_plus_the_step_outputs():
    for i, (bs, w, dt) in enumerate(CASES):
        target, verify_ids, prefix = make_case(bs, w, dt, seed=i)
        drafts = verify_ids[:, 1:]
        logits = torch.nn.functional.one_hot(target, 50_001).float()  # argmax = target
        commit_lens, tokens = verify_greedy(drafts, logits)
        got = dict(zip(NAMES, greedy_accept_torch(target, drafts, prefix)))
        assert torch.equal(got["commit_lens"], commit_lens) and torch.equal(got["tokens"], tokens)
        # request r agrees on its first r % W drafts (the make_case construction): every length is exercised
        assert got["commit_lens"].tolist() == [r % w + 1 for r in range(bs)]
        assert torch.equal(got["bonus"], target[torch.arange(bs), commit_lens - 1])
        assert torch.equal(got["next_ids"], tokens.clamp_min(0).reshape(-1))
        assert got["accept_lens"].dtype == torch.int32 and torch.equal(got["accept_lens"].long(), commit_lens)
        assert got["new_lens"].dtype == dt and torch.equal(got["new_lens"].long(), prefix.long() + commit_lens)


def test_plain_accept_is_greedy_accept_at_width_one():
    from sglang_dflash.kernels.greedy_accept import plain_accept

    for i, dt in enumerate((torch.int64, torch.int32)):
        target, verify_ids, prefix = make_case(9, 1, dt, seed=10 + i)
        want = dict(zip(NAMES, greedy_accept_torch(target, verify_ids[:, 1:], prefix)))
        got = dict(zip(NAMES, plain_accept(target, prefix)))
        for name in NAMES:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_verify_metadata_torch_twin_is_the_definition():
    from sglang_dflash.kernels.verify_metadata import verify_metadata_torch

    args, out = metadata_case(7, 5, torch.int32, True, None, seed=3)
    verify_metadata_torch(**args, **out)
    lens, rows, r2t = args["seq_lens"].long(), args["pool_rows"].long(), args["req_to_token"]
    ends = [int(lens[:r].sum()) for r in range(8)]
    assert out["qo_indptr"][:8].tolist() == [5 * r for r in range(8)] and out["qo_indptr"][8:].eq(-7).all()
    assert out["kv_indptr"][:8].tolist() == ends
    assert out["mask_indptr"][:8].tolist() == [5 * e + 25 * r for r, e in enumerate(ends)]
    want = torch.cat([r2t[q, :n] for q, n in zip(rows, lens)]).long()
    assert torch.equal(out["kv_indices"][: ends[-1]], want) and out["kv_indices"][ends[-1]:].eq(-7).all()


def test_verify_metadata_hook_leaves_other_cases_to_sglang(monkeypatch):
    """EAGLE-style custom masks, windows over slots we do not translate (a unified pool's, another pool's), other
    spec inputs and the switch run SGLang's function."""
    import types

    from sglang_dflash.serving.verify_metadata import METADATA_ENV, update_target_verify_buffers

    class DFlashVerifyInput:  # the hook recognises DFLASH's spec input by its class name
        def __init__(self, **kw):
            self.__dict__.update({"custom_mask": None, "draft_token_num": 16, **kw})

    def sglang(self, *args):
        return "sglang"

    plain = types.SimpleNamespace(sliding_window_size=None)
    for backend, spec in ((plain, DFlashVerifyInput(custom_mask=torch.ones(4))), (plain, None),
                          (plain, types.SimpleNamespace(custom_mask=None, draft_token_num=16)),
                          (types.SimpleNamespace(sliding_window_size=512, _translate_kv_loc=lambda x: x),
                           DFlashVerifyInput()),
                          (types.SimpleNamespace(sliding_window_size=512, token_to_kv_pool=types.SimpleNamespace(
                              translate_loc_from_full_to_swa=lambda x: x)), DFlashVerifyInput())):
        assert update_target_verify_buffers(sglang, backend, 1, torch.ones(1), torch.zeros(1), spec) == "sglang"
    monkeypatch.setenv(METADATA_ENV, "sglang")
    assert update_target_verify_buffers(sglang, plain, 1, torch.ones(1), torch.zeros(1), DFlashVerifyInput()) == \
        "sglang"
    monkeypatch.setenv(METADATA_ENV, "bogus")
    with pytest.raises(ValueError, match=METADATA_ENV):
        update_target_verify_buffers(sglang, plain, 1, torch.ones(1), torch.zeros(1), DFlashVerifyInput())


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


def test_interpreted_kernels_equal_torch_twins(interpreted):
    assert len(interpreted) == len(CASES) + len(BLOCK_CASES) + len(META_CASES) + 6
    assert_all_equal(interpreted)


@needs_gpu
def test_gpu_kernels_equal_torch_twins():
    assert_all_equal(_kernel_vs_twin("cuda"))


if __name__ == "__main__" and "--interpret" in sys.argv:
    print_interpreted(_kernel_vs_twin)
