"""A verify pass's attention metadata in one launch.

Before each CUDA-graph replay of a TARGET_VERIFY pass (our draft pass and our verify both are one), SGLang's triton
backend refills its graph buffers for the padded batch (request ``r``: ``n_r`` = seq_lens[r] attended prefix tokens,
request-pool row ``q_r``; ``W`` query tokens per request)::

    qo_indptr[r]   = r * W                               for r = 0..bs
    kv_indptr[r]   = n_0 + ... + n_{r-1}                 for r = 0..bs
    kv_indices[kv_indptr[r] : kv_indptr[r+1]] = req_to_token[q_r, 0 : n_r]
    mask_indptr[r] = sum over s < r of W * (n_s + W)     for r = 0..bs   (where a custom-mask buffer exists)

On a backend with sliding-window layers (Gemma-4, gpt-oss) it also fills the window's buffers, over the last
``w_r = min(n_r, window)`` prefix tokens, each slot translated to the sliding-window pool's own slot where the pool
keeps one (``SWAKVPool.full_to_swa_index_mapping``)::

    window_kv_indptr[r]  = w_0 + ... + w_{r-1}           for r = 0..bs
    window_kv_indices[window_kv_indptr[r] : ...] = map[req_to_token[q_r, n_r - w_r : n_r]]
    window_kv_offsets[r] = n_r - w_r                     for r = 0..bs-1

SGLang's ``update_sliding_window_buffer`` does that with several launches and a host synchronisation (it slices the
index buffer by a device scalar, ``.item()``), which stalls the host on every verify of such a target until the GPU
has drained: overlap scheduling then hides nothing (profile of the Gemma-4-26B-A4B shape, 2026-11-27).

``TritonAttnBackend._update_target_verify_buffers`` does the non-window part with eight small launches (an arange,
two cumsums, their slice copies, the mask lengths' arithmetic and the index-copy kernel); on a host-bound target
they cost ~0.5 ms of a 3.4 ms step, twice per step (py-spy, benchmarks/results/host-profile-smollm2-h100).
``verify_metadata`` writes all of it with one launch: program ``r`` sums the lengths before it (``bs`` is at most a
few hundred, so the O(bs^2) loads are nothing next to a launch) and copies its own slot row (and its window's).
``verify_metadata_torch`` is the same function in torch: the reference (``tests/test_step_kernels.py``, Triton's
interpreter on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_REQS = 128   # lengths summed per iteration of a program's prefix loop
BLOCK_SLOTS = 512  # slots copied per iteration of a program's row copy


@triton.jit
def _verify_metadata_kernel(seq_lens_ptr, pool_rows_ptr, req_to_token_ptr, r2t_stride, W, qo_indptr_ptr,
                            kv_indptr_ptr, kv_indices_ptr, mask_indptr_ptr, window, win_indptr_ptr, win_indices_ptr,
                            win_offsets_ptr, swa_map_ptr, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                            HAS_MAP: tl.constexpr, BLOCK_REQS: tl.constexpr, BLOCK_SLOTS: tl.constexpr):
    r = tl.program_id(0)
    start = r.to(tl.int64) * 0
    wstart = start
    for s in range(0, r, BLOCK_REQS):
        offs = s + tl.arange(0, BLOCK_REQS)
        before = tl.load(seq_lens_ptr + offs, mask=offs < r, other=0).to(tl.int64)
        start += tl.sum(before)
        if HAS_WINDOW:
            wstart += tl.sum(tl.minimum(before, window))
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
        if HAS_WINDOW:
            tl.store(win_indptr_ptr, start.to(win_indptr_ptr.dtype.element_ty))
    row = req_to_token_ptr + tl.load(pool_rows_ptr + r).to(tl.int64) * r2t_stride
    for s in range(0, n, BLOCK_SLOTS):
        offs = s + tl.arange(0, BLOCK_SLOTS)
        keep = offs < n
        slots = tl.load(row + offs, mask=keep)
        tl.store(kv_indices_ptr + start + offs, slots.to(kv_indices_ptr.dtype.element_ty), mask=keep)
    if HAS_WINDOW:
        w = tl.minimum(n, window)
        first = n - w  # the window keeps the last w prefix tokens
        tl.store(win_indptr_ptr + r + 1, (wstart + w).to(win_indptr_ptr.dtype.element_ty))
        tl.store(win_offsets_ptr + r, first.to(win_offsets_ptr.dtype.element_ty))
        for s in range(0, w, BLOCK_SLOTS):
            offs = s + tl.arange(0, BLOCK_SLOTS)
            keep = offs < w
            slots = tl.load(row + first + offs, mask=keep, other=0).to(tl.int64)
            if HAS_MAP:
                slots = tl.load(swa_map_ptr + slots, mask=keep, other=0)
            tl.store(win_indices_ptr + wstart + offs, slots.to(win_indices_ptr.dtype.element_ty), mask=keep)


@dataclass(frozen=True)
class Window:
    """A backend's sliding-window buffers for ``verify_metadata``: ``size`` prefix tokens are kept (SGLang's
    ``sliding_window_size``); ``swa_map`` (optional) translates a full-pool slot to the window pool's."""

    size: int
    indptr: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    swa_map: torch.Tensor | None = None


def _check(seq_lens, pool_rows, qo_indptr, kv_indptr, mask_indptr, window=None):
    bs = seq_lens.shape[0]
    if pool_rows.shape[0] != bs:
        raise ValueError(f"verify_metadata: {pool_rows.shape[0]} pool rows for {bs} requests")
    if window is not None and not window.size > 0:
        raise ValueError(f"verify_metadata: a sliding window of {window.size} tokens (must be > 0)")
    if window is not None and window.offsets.shape[0] < bs:
        raise ValueError(f"verify_metadata: window offsets hold {window.offsets.shape[0]} of {bs} requests")
    named = (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("mask_indptr", mask_indptr),
             ("window indptr", None if window is None else window.indptr))
    for name, t in named:
        if t is not None and (t.dim() != 1 or t.shape[0] < bs + 1 or not t.is_contiguous()):
            raise ValueError(f"verify_metadata: {name} must be a contiguous 1-D buffer of at least {bs + 1}")


def verify_metadata(seq_lens, pool_rows, req_to_token, width: int, qo_indptr, kv_indptr, kv_indices,
                    mask_indptr=None, window: Window | None = None) -> None:
    """Fill qo_indptr / kv_indptr / mask_indptr [: bs + 1] and kv_indices, and the window's buffers when given (CUDA;
    one launch). seq_lens, pool_rows [bs] (any integer dtypes); req_to_token [rows, max_len]; mask_indptr None to
    leave it alone."""
    _check(seq_lens, pool_rows, qo_indptr, kv_indptr, mask_indptr, window)
    bs = seq_lens.shape[0]
    if bs:
        w = window
        _verify_metadata_kernel[(bs,)](
            seq_lens, pool_rows, req_to_token, req_to_token.stride(0), width, qo_indptr, kv_indptr, kv_indices,
            qo_indptr if mask_indptr is None else mask_indptr, 0 if w is None else int(w.size),
            qo_indptr if w is None else w.indptr, qo_indptr if w is None else w.indices,
            qo_indptr if w is None else w.offsets, qo_indptr if w is None or w.swa_map is None else w.swa_map,
            HAS_MASK=mask_indptr is not None, HAS_WINDOW=w is not None, HAS_MAP=w is not None and w.swa_map is not None,
            BLOCK_REQS=BLOCK_REQS, BLOCK_SLOTS=BLOCK_SLOTS)


def verify_metadata_torch(seq_lens, pool_rows, req_to_token, width: int, qo_indptr, kv_indptr, kv_indices,
                          mask_indptr=None, window: Window | None = None) -> None:
    """``verify_metadata`` in torch (the reference; a host sync per call, so never on the serving path)."""
    _check(seq_lens, pool_rows, qo_indptr, kv_indptr, mask_indptr, window)
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
    if window is None:
        return
    kept = lens.clamp(max=window.size)
    wends = torch.cumsum(kept, 0)
    window.indptr[0] = 0
    window.indptr[1: bs + 1] = wends
    window.offsets[:bs] = lens - kept
    for q, n, w, end in zip(pool_rows.tolist(), lens.tolist(), kept.tolist(), wends.tolist()):
        slots = req_to_token[q, n - w: n].to(torch.int64)
        window.indices[end - w: end] = slots if window.swa_map is None else window.swa_map[slots]
