"""A greedy verify's accept and commit bookkeeping in one launch.

After the target's verify pass, a greedy step needs, per request ``r`` (``W`` = verify width, ``t`` = the target's
argmax ids ``[bs, W]``, ``d`` = the drafts ``[bs, W-1]``, ``a`` = accepted drafts = length of the longest prefix with
``d[i] == t[i]``)::

    commit_lens[r] = a + 1                        (int64; SGLang's accept_lens = the same as int32)
    tokens[r, i]   = t[r, i] if i <= a else -1    (the committed tokens, -1 padded: controls and logprobs read it)
    next_ids[r*W + i] = max(tokens[r, i], 0)      (SGLang's next_token_ids layout)
    bonus[r]       = t[r, a]                      (the next step's first token)
    new_lens[r]    = prefix[r] + a + 1

In torch that is ~14 small launches (eq, cumprod, sum, arange, gt, masked_fill, sub, gather, clamp, casts, add) on
the host path of every step; on a small target the step is host-bound, so each launch costs wall time
(benchmarks/results/fastpath-smollm2-h100). ``greedy_accept_torch`` is the same function in torch, built from the
foundation's ``acceptance.verify_greedy``; it is the CPU path and the kernel's reference
(``tests/test_kernels.py::test_greedy_accept_*``, Triton's interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..acceptance import verify_greedy_ids


@triton.jit
def _greedy_accept_kernel(target_ptr, drafts_ptr, drafts_stride, prefix_ptr, tokens_ptr, next_ptr, bonus_ptr,
                          commit_ptr, accept32_ptr, new_lens_ptr, W, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    in_w = offs < W
    t = tl.load(target_ptr + r * W + offs, mask=in_w, other=0)
    d = tl.load(drafts_ptr + r * drafts_stride + offs, mask=offs < W - 1, other=-1)
    # the first position that does not extend the accepted prefix: a mismatching draft, or W - 1 (the bonus slot)
    stop = (d != t) | (offs >= W - 1)
    a = tl.min(tl.where(stop, offs, BLOCK), axis=0)
    keep = offs <= a
    tl.store(tokens_ptr + r * W + offs, tl.where(keep, t, -1), mask=in_w)
    tl.store(next_ptr + r * W + offs, tl.where(keep, t, 0), mask=in_w)
    tl.store(bonus_ptr + r, tl.sum(tl.where(offs == a, t, 0), axis=0))
    tl.store(commit_ptr + r, (a + 1).to(tl.int64))
    tl.store(accept32_ptr + r, (a + 1).to(tl.int32))
    p = tl.load(prefix_ptr + r)
    tl.store(new_lens_ptr + r, p + (a + 1).to(p.dtype))


def greedy_accept(target_ids: torch.Tensor, drafts: torch.Tensor, prefix: torch.Tensor):
    """(commit_lens, tokens, next_ids, bonus, accept_lens, new_lens) of a greedy verify, in one launch (CUDA).

    target_ids [bs, W] int64 contiguous; drafts [bs, W-1] int64 with unit column stride (a column slice of the
    verify ids is fine; W = 1, a plain step, has none); prefix [bs] (the committed lengths, any integer dtype;
    new_lens keeps it). At least 16 lanes (masked past W), so W = 1 compiles like any other width."""
    bs, w = target_ids.shape
    if drafts.shape != (bs, w - 1) or (w > 1 and drafts.stride(1) != 1) or not target_ids.is_contiguous():
        raise ValueError(f"greedy_accept: target_ids {tuple(target_ids.shape)} (contiguous), drafts "
                         f"{tuple(drafts.shape)} with unit column stride expected")
    commit, tokens, next_ids, bonus, accept32, new_lens = accept_outputs(bs, w, prefix)
    if bs:
        _greedy_accept_kernel[(bs,)](target_ids, drafts, drafts.stride(0) if w > 1 else 0, prefix, tokens, next_ids,
                                     bonus, commit, accept32, new_lens, w, BLOCK=max(triton.next_power_of_2(w), 16))
    return commit, tokens, next_ids, bonus, accept32, new_lens


def accept_outputs(bs: int, width: int, prefix: torch.Tensor):
    """Uninitialised (commit_lens, tokens, next_ids, bonus, accept_lens, new_lens) of ``bs`` requests, ``width``
    verified rows each, for a fused accept to fill: the dtypes and layouts ``commit_outputs`` returns."""
    def longs(*shape):
        return torch.empty(shape, dtype=torch.int64, device=prefix.device)

    return (longs(bs), longs(bs, width), longs(bs * width), longs(bs),
            torch.empty((bs,), dtype=torch.int32, device=prefix.device), torch.empty_like(prefix))


def commit_outputs(commit_lens: torch.Tensor, tokens: torch.Tensor, prefix: torch.Tensor):
    """(next_ids, bonus, accept_lens, new_lens) from any acceptance rule's (commit_lens, tokens): THE definition of
    the step's outputs, used by the sampled path and by the torch twin below."""
    bonus = tokens.gather(1, (commit_lens - 1)[:, None])[:, 0]
    return (tokens.clamp_min(0).reshape(-1), bonus, commit_lens.to(torch.int32),
            prefix + commit_lens.to(prefix.dtype))


def plain_accept(target_ids: torch.Tensor, prefix: torch.Tensor):
    """``greedy_accept`` of a plain step (W = 1, no drafts): the target's argmax is the one committed token. Four
    cheap torch launches (two fills, a view, an add) instead of the Triton launch, whose Python launcher alone
    (~0.1 ms, benchmarks/results/k0-host-h100) is host time on every k = 0 step, the step the adaptive floor is
    made of. The same outputs as greedy_accept / greedy_accept_torch at W = 1 (tests/test_step_kernels.py)."""
    bs = target_ids.shape[0]
    commit = torch.ones((bs,), dtype=torch.int64, device=target_ids.device)
    tokens = target_ids.view(bs, 1)
    return (commit, tokens, tokens.reshape(-1), tokens[:, 0], torch.ones((bs,), dtype=torch.int32,
                                                                          device=target_ids.device), prefix + 1)


def greedy_accept_torch(target_ids: torch.Tensor, drafts: torch.Tensor, prefix: torch.Tensor):
    """``greedy_accept`` in torch: the foundation's rule (``acceptance.verify_greedy_ids``), then
    ``commit_outputs``."""
    commit_lens, tokens = verify_greedy_ids(drafts, target_ids)
    return (commit_lens, tokens) + commit_outputs(commit_lens, tokens, prefix)
