"""The decode step's fused kernels (``sglang_dflash.kernels.greedy_accept`` / ``block_inputs``) == their torch twins.

The Triton kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before triton is first
imported); on CUDA natively too. Greedy accept: every accepted length 0..W-1 (all drafts rejected, some, all), widths
2..32 (non-powers of two), drafts read as a column slice of the verify ids (stride W), int32 / int64 committed
lengths; its twin equals the foundation's rule (``acceptance.verify_greedy``). Block inputs: int32 req_to_token rows
in a permuted order, int32 / int64 lengths, block sizes 4..16, verify ids of another width.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from _interpreter import run_interpreted

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


CASES = [(bs, w, dt) for bs, w in ((1, 2), (3, 4), (17, 16), (40, 8), (33, 32), (5, 13)) for dt in (torch.int64,
                                                                                                     torch.int32)]


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


BLOCK_CASES = [(1, 16, 16, torch.int64), (5, 16, 8, torch.int32), (9, 4, 2, torch.int64), (3, 13, 13, torch.int32)]


def _kernel_vs_twin(device: str) -> dict[str, bool]:
    from sglang_dflash.kernels.block_inputs import block_inputs, block_inputs_torch
    from sglang_dflash.kernels.greedy_accept import greedy_accept

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


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


def test_interpreted_kernels_equal_torch_twins(interpreted):
    assert len(interpreted) == len(CASES) + len(BLOCK_CASES)
    assert all(interpreted.values()), f"cases that differ: {[k for k, ok in interpreted.items() if not ok]}"


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU")
def test_gpu_kernels_equal_torch_twins():
    got = _kernel_vs_twin("cuda")
    assert all(got.values()), f"cases that differ: {[k for k, ok in got.items() if not ok]}"


if __name__ == "__main__" and "--interpret" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    torch.set_num_threads(1)
    print(json.dumps(_kernel_vs_twin("cpu")))
