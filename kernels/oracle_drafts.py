"""Oracle drafts (benchmarks only, issue #45): a step's drafts replaced by the recorded continuation in one launch.

Request ``r`` of a decode step (verify ids ``ids[r] = [bonus, d_1..d_k]``, committed length ``p``, request-pool row
``q``) whose prompt has a recording (``slot_row[q] >= 0``: row of ``table``, ``table_len`` tokens, prompt length
``slot_plen[q]``, prompt hash ``slot_key[q]``) has its bonus at output position ``t = p - slot_plen[q]``. Then::

    d_j := rec[t + j]                     where hash(seed, key, t + j) <  keep   (the position is "easy")
    d_j := (rec[t + j] + 1) % vocab       where hash(seed, key, t + j) >= keep   (a miss: certain to be rejected
                                                                                  while the target follows rec)

for every j in 1..k with t + j < table_len; other drafts (no recording, past its end) stay the drafter's. The misses
are a property of (seed, prompt, output position), not of the step: a step starting at t accepts drafts up to the
first miss after t, so with keep = p * 2^32 its accepted drafts are geometric (P(>= j) = p^j, capped at k), and
every method, batch composition, batch order and tensor-parallel rank sees the same misses.

The same launch checks the bonus (the token the target committed last) against rec[t]: a difference means the target
diverged from the recorded plain run; ``div_first[row]`` keeps the earliest such position (atomic min), ``div_count``
counts them. Accepted drafts equal the drafts, which are rec's tokens up to the first miss, so a divergence inside
a commit shows at the next bonus (or in the run's output check against plain decoding).

The hash is lowbias32 (Wellons) in int64 arithmetic with every product below 2^49 (``_mul32`` splits the 32-bit
multiply), so the Triton kernel and ``oracle_drafts_torch`` (the CPU path and the reference) give identical bits.
No host sync, fixed shapes: capturable, and cheap enough to run right after the draft (graph replay or eager).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

M32 = 0xFFFFFFFF
_C1, _C2, _GOLD = 0x7FEB352D, 0x846CA68B, 0x9E3779B9
NO_DIVERGENCE = 2 ** 62  # div_first's initial value


# The hash's constants reach the kernel as runtime int64 arguments: literals of 2^31..2^32 would be typed uint32
# by Triton's front end, and the products must be int64 arithmetic on every backend.
@triton.jit
def _mul32(x, c, m32):
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & m32


@triton.jit
def _mix32(x, c1, c2, m32):
    x = x ^ (x >> 16)
    x = _mul32(x, c1, m32)
    x = x ^ (x >> 15)
    x = _mul32(x, c2, m32)
    return x ^ (x >> 16)


@triton.jit
def _oracle_kernel(ids_ptr, ids_stride, k, prefix_ptr, pool_rows_ptr, slot_row_ptr, slot_plen_ptr, slot_key_ptr,
                   table_ptr, table_stride, table_len_ptr, div_first_ptr, div_count_ptr, seed, keep, vocab,
                   c1, c2, gold, m32, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    q = tl.load(pool_rows_ptr + r).to(tl.int64)
    row = tl.load(slot_row_ptr + q)
    has = row >= 0
    row = tl.where(has, row, 0)
    t = tl.load(prefix_ptr + r).to(tl.int64) - tl.load(slot_plen_ptr + q)
    key = tl.load(slot_key_ptr + q)
    length = tl.where(has, tl.load(table_len_ptr + row), 0)
    in_rec = has & (t >= 0) & (t < length)
    rec_bonus = tl.load(table_ptr + row * table_stride + t, mask=in_rec, other=0).to(tl.int64)
    bonus = tl.load(ids_ptr + r * ids_stride)
    diverged = in_rec & (rec_bonus != bonus)
    tl.atomic_min(div_first_ptr + row, t, mask=diverged)
    tl.atomic_add(div_count_ptr + row, t * 0 + 1, mask=diverged)  # an int64 one
    offs = tl.arange(0, BLOCK)
    pos = t + 1 + offs
    cover = has & (offs < k) & (pos >= 0) & (pos < length)
    true = tl.load(table_ptr + row * table_stride + pos, mask=cover, other=0).to(tl.int64)
    h = _mix32((pos + gold) & m32, c1, c2, m32)
    h = _mix32(h ^ key, c1, c2, m32)
    h = _mix32(h ^ seed, c1, c2, m32)
    new = tl.where(h < keep, true, (true + 1) % vocab)
    tl.store(ids_ptr + r * ids_stride + 1 + offs, new, mask=cover)


def _check(ids, table):
    if ids.dtype != torch.int64 or ids.stride(1) != 1:
        raise ValueError(f"oracle_drafts: ids must be int64 with contiguous rows, got {ids.dtype} {ids.stride()}")
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError("oracle_drafts: table must be a 2-D tensor with contiguous rows")


def oracle_drafts(ids, prefix, pool_rows, slot_row, slot_plen, slot_key, table, table_len, div_first, div_count,
                  seed: int, keep: int, vocab: int):
    """Replace ids[:, 1:] (the drafts) in place and check ids[:, 0] (the bonus) against the recording (CUDA; one
    launch). ids [bs, k + 1] int64; prefix, pool_rows [bs]; slot_row, slot_plen, slot_key [pool rows] int64;
    table [R, L] (int32 or int64); table_len, div_first, div_count [R] int64."""
    _check(ids, table)
    bs, width = ids.shape
    if bs and width > 1:
        _oracle_kernel[(bs,)](ids, ids.stride(0), width - 1, prefix, pool_rows, slot_row, slot_plen, slot_key,
                              table, table.stride(0), table_len, div_first, div_count, seed, keep, vocab,
                              _C1, _C2, _GOLD, M32, BLOCK=max(triton.next_power_of_2(width - 1), 16))


def _mul32_torch(x: torch.Tensor, c: int) -> torch.Tensor:
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in 0..2^32-1 (torch; every intermediate below 2^49)."""
    x = x ^ (x >> 16)
    x = _mul32_torch(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32_torch(x, _C2)
    return x ^ (x >> 16)


def position_hash(seed: int, key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The counter-based draw of output position ``pos`` of the prompt with hash ``key`` (int64 in 0..2^31-1):
    uniform on 0..2^32-1; a position is kept (an easy token) where it is below ``keep``."""
    return mix32(mix32(mix32((pos + _GOLD) & M32) ^ key) ^ seed)


def oracle_drafts_torch(ids, prefix, pool_rows, slot_row, slot_plen, slot_key, table, table_len, div_first,
                        div_count, seed: int, keep: int, vocab: int):
    """``oracle_drafts`` in torch (the CPU path and the reference); no host sync, fixed shapes."""
    _check(ids, table)
    bs, width = ids.shape
    if bs == 0 or width == 1:
        return
    q = pool_rows.to(torch.int64)
    row = slot_row[q]
    has = row >= 0
    row = row.clamp(min=0)
    t = prefix.to(torch.int64) - slot_plen[q]
    key = slot_key[q]
    length = table_len[row].masked_fill(~has, 0)
    L = table.shape[1]
    # the bonus against the recording
    ok_b = has & (t >= 0) & (t < length)
    rec_bonus = table[row, t.clamp(0, L - 1)].to(torch.int64)
    diverged = ok_b & (rec_bonus != ids[:, 0])
    div_first.scatter_reduce_(0, row, t.masked_fill(~diverged, NO_DIVERGENCE), reduce="amin")
    div_count.index_add_(0, row, diverged.to(div_count.dtype))
    # the drafts
    pos = t[:, None] + 1 + torch.arange(width - 1, device=ids.device)
    cover = has[:, None] & (pos >= 0) & (pos < length[:, None])
    true = table[row[:, None], pos.clamp(0, L - 1)].to(torch.int64)
    h = position_hash(seed, key[:, None], pos)
    new = torch.where(h < keep, true, (true + 1) % vocab)
    ids[:, 1:] = torch.where(cover, new, ids[:, 1:])
