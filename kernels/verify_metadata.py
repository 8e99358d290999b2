"""A verify pass's attention metadata in one launch.

Before each CUDA-graph replay of a TARGET_VERIFY pass (our draft pass and our verify both are one), SGLang's triton
backend refills its graph buffers for the padded batch (request ``r``: ``n_r`` = seq_lens[r] attended prefix tokens,
request-pool row ``q_r``; ``W`` query tokens per request)::

    qo_indptr[r]   = r * W                               for r = 0..bs
    kv_indptr[r]   = n_0 + ... + n_{r-1}                 for r = 0..bs
    kv_indices[kv_indptr[r] : kv_indptr[r+1]] = req_to_token[q_r, 0 : n_r]
    mask_indptr[r] = sum over s < r of W * (n_s + W)     for r = 0..bs   (where a custom-mask buffer exists)

``TritonAttnBackend._update_target_verify_buffers`` does that with eight small launches (an arange, two cumsums,
their slice copies, the mask lengths' arithmetic and the index-copy kernel); on a host-bound target they cost
~0.5 ms of a 3.4 ms step, twice per step (py-spy, benchmarks/results/host-profile-smollm2-h100). ``verify_metadata``
writes all four with one launch: program ``r`` sums the lengths before it (``bs`` is at most a few hundred, so the
O(bs^2) loads are nothing next to a launch) and copies its own slot row. ``verify_metadata_torch`` is the same
function in torch: the reference (``tests/test_step_kernels.py``, Triton's interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_REQS = 128   # lengths summed per iteration of a program's prefix loop
BLOCK_SLOTS = 512  # slots copied per iteration of a program's row copy


@triton.jit
def _verify_metadata_kernel(seq_lens_ptr, pool_rows_ptr, req_to_token_ptr, r2t_stride, W, qo_indptr_ptr,
                            kv_indptr_ptr, kv_indices_ptr, mask_indptr_ptr, HAS_MASK: tl.constexpr,
                            BLOCK_REQS: tl.constexpr, BLOCK_SLOTS: tl.constexpr):
    r = tl.program_id(0)
    start = r.to(tl.int64) * 0
    for s in range(0, r, BLOCK_REQS):
        offs = s + tl.arange(0, BLOCK_REQS)
        start += tl.sum(tl.load(seq_lens_ptr + offs, mask=offs < r, other=0).to(tl.int64))
    n = tl.load(seq_lens_ptr + r).to(tl.int64)
    end = start + n
    tl.store(qo_indptr_ptr + r + 1, ((r + 1) * W).to(qo_indptr_ptr.dtype.element_ty))
    tl.store(kv_indptr_ptr + r + 1, end.to(kv_indptr_ptr.dtype.element_ty))
    if HAS_MASK:
        tl.store(mask_indptr_ptr + r + 1, (W * end + W * W * (r + 1)).to(mask_indptr_ptr.dtype.element_ty))
    if r == 0:
        tl.store(qo_indptr_ptr, start.to(qo_indptr_ptr.dtype.element_ty))  # start = 0 for request 0
        tl.store(kv_indptr_ptr, start.to(kv_indptr_ptr.dtype.element_ty))
        if HAS_MASK:
            tl.store(mask_indptr_ptr, start.to(mask_indptr_ptr.dtype.element_ty))
    row = req_to_token_ptr + tl.load(pool_rows_ptr + r).to(tl.int64) * r2t_stride
    for s in range(0, n, BLOCK_SLOTS):
        offs = s + tl.arange(0, BLOCK_SLOTS)
        keep = offs < n
        slots = tl.load(row + offs, mask=keep)
        tl.store(kv_indices_ptr + start + offs, slots.to(kv_indices_ptr.dtype.element_ty), mask=keep)


def _check(seq_lens, pool_rows, qo_indptr, kv_indptr, mask_indptr):
    bs = seq_lens.shape[0]
    if pool_rows.shape[0] != bs:
        raise ValueError(f"verify_metadata: {pool_rows.shape[0]} pool rows for {bs} requests")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("mask_indptr", mask_indptr)):
        if t is not None and (t.dim() != 1 or t.shape[0] < bs + 1 or not t.is_contiguous()):
            raise ValueError(f"verify_metadata: {name} must be a contiguous 1-D buffer of at least {bs + 1}")


def verify_metadata(seq_lens, pool_rows, req_to_token, width: int, qo_indptr, kv_indptr, kv_indices,
                    mask_indptr=None) -> None:
    """Fill qo_indptr / kv_indptr / mask_indptr [: bs + 1] and kv_indices (CUDA; one launch). seq_lens, pool_rows
    [bs] (any integer dtypes); req_to_token [rows, max_len]; mask_indptr None to leave it alone."""
    _check(seq_lens, pool_rows, qo_indptr, kv_indptr, mask_indptr)
    bs = seq_lens.shape[0]
    if bs:
        _verify_metadata_kernel[(bs,)](seq_lens, pool_rows, req_to_token, req_to_token.stride(0), width, qo_indptr,
                                       kv_indptr, kv_indices, qo_indptr if mask_indptr is None else mask_indptr,
                                       HAS_MASK=mask_indptr is not None, BLOCK_REQS=BLOCK_REQS,
                                       BLOCK_SLOTS=BLOCK_SLOTS)


def verify_metadata_torch(seq_lens, pool_rows, req_to_token, width: int, qo_indptr, kv_indptr, kv_indices,
                          mask_indptr=None) -> None:
    """``verify_metadata`` in torch (the reference; a host sync per call, so never on the serving path)."""
    _check(seq_lens, pool_rows, qo_indptr, kv_indptr, mask_indptr)
    bs = seq_lens.shape[0]
    lens = seq_lens.to(torch.int64)
    ends = torch.cumsum(lens, 0)
    qo_indptr[: bs + 1] = torch.arange(bs + 1, device=lens.device) * width
    kv_indptr[0] = 0
    kv_indptr[1: bs + 1] = ends
    if mask_indptr is not None:
        mask_indptr[0] = 0
        mask_indptr[1: bs + 1] = torch.cumsum(width * (lens + width), 0)
    for q, n, end in zip(pool_rows.tolist(), lens.tolist(), ends.tolist()):
        kv_indices[end - n: end] = req_to_token[q, :n]
