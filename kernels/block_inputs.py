"""A speculative step's block inputs in one launch.

Before the draft pass, request ``r`` (bonus token ``b``, committed length ``p``, request-pool row ``q``) needs::

    block_ids[r]  = [b, MASK, ..., MASK]                 (B ids: the drafter's input)
    positions[r]  = [p, p + 1, ..., p + B - 1]
    cache_loc[r]  = req_to_token[q, p : p + B]           (the KV slots the scheduler reserved for them)
    verify_ids[r, 0] = b                                 (the verify's first token; drafts follow it)

In torch that is five or six small launches (two copies, an add, the index gather and its casts) on the host path of
every step; ``block_inputs`` writes all four with one. ``block_inputs_torch`` is the same function in torch: the CPU
path and the kernel's reference (``tests/test_step_kernels.py``, Triton's interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_inputs_kernel(bonus_ptr, prefix_ptr, pool_rows_ptr, req_to_token_ptr, r2t_stride, mask_id, block_ids_ptr,
                         positions_ptr, cache_loc_ptr, verify_ids_ptr, verify_stride, B, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    in_b = offs < B
    bonus = tl.load(bonus_ptr + r)
    pos = tl.load(prefix_ptr + r).to(tl.int64) + offs
    row = tl.load(pool_rows_ptr + r).to(tl.int64)
    tl.store(block_ids_ptr + r * B + offs, tl.where(offs == 0, bonus, mask_id), mask=in_b)
    tl.store(positions_ptr + r * B + offs, pos, mask=in_b)
    slots = tl.load(req_to_token_ptr + row * r2t_stride + pos, mask=in_b)
    tl.store(cache_loc_ptr + r * B + offs, slots.to(tl.int64), mask=in_b)
    tl.store(verify_ids_ptr + r * verify_stride, bonus)


def _check(block_ids, positions, cache_loc, verify_ids):
    for name, t in (("block_ids", block_ids), ("positions", positions), ("cache_loc", cache_loc)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != block_ids.shape:
            raise ValueError(f"block_inputs: {name} must be contiguous int64 {tuple(block_ids.shape)}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if verify_ids.dtype != torch.int64 or verify_ids.shape[0] != block_ids.shape[0]:
        raise ValueError(f"block_inputs: verify_ids must be int64 with {block_ids.shape[0]} rows")


def block_inputs(bonus, prefix, pool_rows, req_to_token, mask_id: int, block_ids, positions, cache_loc, verify_ids):
    """Fill block_ids, positions, cache_loc [bs, B] and verify_ids[:, 0] (CUDA; one launch). bonus, prefix,
    pool_rows [bs] (any integer dtypes); req_to_token [rows, max_len]."""
    _check(block_ids, positions, cache_loc, verify_ids)
    bs, B = block_ids.shape
    if bs:
        _block_inputs_kernel[(bs,)](bonus, prefix, pool_rows, req_to_token, req_to_token.stride(0), mask_id,
                                    block_ids, positions, cache_loc, verify_ids, verify_ids.stride(0), B,
                                    BLOCK=max(triton.next_power_of_2(B), 16))  # lanes past B are masked


def block_inputs_torch(bonus, prefix, pool_rows, req_to_token, mask_id: int, block_ids, positions, cache_loc,
                       verify_ids):
    """``block_inputs`` in torch (the CPU path and the reference)."""
    _check(block_ids, positions, cache_loc, verify_ids)
    B = block_ids.shape[1]
    block_ids[:, 0] = bonus
    block_ids[:, 1:] = mask_id
    torch.add(prefix[:, None].to(torch.int64), torch.arange(B, device=prefix.device), out=positions)
    cache_loc.copy_(req_to_token[pool_rows.to(torch.int64)[:, None], positions])
    verify_ids[:, 0] = bonus
