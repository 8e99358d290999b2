"""Plain-torch stand-ins for what SGLang's CPU engine lacks on a PyPI install (used on CPU only, via plugin hooks).

- ``assign_req_to_token_pool``: SGLang calls sgl_kernel's ``assign_req_to_token_pool_cpu``, which the CUDA-only
  PyPI wheel does not ship; speculative KV reservation (prepare_for_decode) needs it.
- torch_native attention has no TARGET_VERIFY branch (``verify_attention``: W query rows per request over its
  committed K/V and the W new rows, causal or under a draft tree's ancestor mask (tree verify, tree_step.py),
  where torch_native's extend path would build a query as long as the whole context and cost O(context^2) per
  layer, the CPU verify's main cost before).
- ``StreamlessIndices``: overlap scheduling calls ``record_stream`` on the FutureMap's index tensor; that op exists
  for CUDA tensors only. On CPU there are no streams, so recording one is a no-op.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_torch(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                   start_offset: torch.Tensor, end_offset: torch.Tensor,
                                   out_cache_loc: torch.Tensor) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th consecutive run of out_cache_loc."""
    lens = (end_offset - start_offset).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    if rows.numel() == 0:
        return
    first = torch.cumsum(lens, 0) - lens  # where row i's run starts in out_cache_loc
    col = start_offset.to(torch.int64)[rows] + torch.arange(rows.numel(), device=lens.device) - first[rows]
    req_to_token[req_pool_indices.to(torch.int64)[rows], col] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


class StreamlessIndices(torch.Tensor):
    """A CPU index tensor whose ``record_stream`` is a no-op (CPU work is synchronous: nothing to pin).

    Torch-function dispatch is disabled, so results computed from it (e.g. ``buf[indices]``) are plain tensors.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def record_stream(self, stream) -> None:
        return None


def verify_width(forward_batch) -> int:
    """W, the tokens per request of a TARGET_VERIFY batch: from the batch (its spec_info's ``draft_token_num``, else
    tokens / requests), never from the shape of q: model classes hand attention q in different layouts (Gemma-3
    passes [1, N, heads, dim])."""
    bs = forward_batch.batch_size
    n = forward_batch.positions.numel()
    width = getattr(forward_batch.spec_info, "draft_token_num", None) or n // bs
    if width * bs != n:
        raise RuntimeError(f"TARGET_VERIFY batch of {bs} requests x block {width} != {n} positions")
    return width


def verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, width: int, *, scale,
                     causal: bool, sliding_window: int | None = None, tree_depth: torch.Tensor | None = None,
                     tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a TARGET_VERIFY batch on CPU: request i's W query rows (q [bs x W, heads, dim], at positions
    prefix_i .. prefix_i + W - 1) over its first prefix_i + W cached K/V rows (the W new ones already written).

    causal: query row j sees keys up to its own position (a verify), else all of them (the drafter's block layers,
    ENCODER_ONLY); sliding_window: SGLang's rule, keys within ``window`` positions before the query too. A row with
    nothing masked (W = 1, or non-causal without a window) gets no mask at all: the k = 0 step computes exactly what
    torch_native's decode step computes for the same token. Returns [bs x W, heads, v_dim].

    Tree verify (issue #38, serving/tree_step.py): ``tree_depth`` [bs, W] and ``tree_mask`` [bs, W, W] bool (row j:
    the block rows query j may see, its ancestors and itself). Block row j then sits at position prefix + depth_j
    (its RoPE was applied at that position by the model): it sees the whole prefix and the block rows of its mask;
    the sliding window compares those positions. Causal layers only (the target's)."""
    bs, H = len(prefix_lens), q.shape[1]
    out = q.new_empty((q.shape[0], H, v_cache.shape[-1]))
    rows = torch.arange(width).unsqueeze(1)
    if tree_mask is not None and not causal:
        raise ValueError("a tree verify attends causally (the target's layers); got a non-causal layer")
    for i, prefix in enumerate(prefix_lens.tolist()):
        length = prefix + width
        slots = req_to_token[req_pool_indices[i], :length]
        key, value = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)  # [kv heads, length, dim]
        if key.dtype != q.dtype:  # sdpa wants one dtype (e.g. an fp8 KV cache)
            key, value = key.to(q.dtype), value.to(q.dtype)
        mask = None
        if tree_mask is not None:
            depth = tree_depth[i].to(torch.int64)
            mask = torch.cat([torch.ones(width, prefix, dtype=torch.bool), tree_mask[i].to(torch.bool)], 1)
            if sliding_window is not None:
                q_pos = prefix + depth.unsqueeze(1)
                k_pos = torch.cat([torch.arange(prefix), prefix + depth]).unsqueeze(0)
                mask &= k_pos >= q_pos - sliding_window
        elif causal and (width > 1 or sliding_window is not None):
            q_pos, k_pos = prefix + rows, torch.arange(length).unsqueeze(0)
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos >= q_pos - sliding_window
        query = q[i * width:(i + 1) * width].movedim(0, 1)  # [heads, W, dim]
        o = torch.nn.functional.scaled_dot_product_attention(
            query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=key.shape[0] != H)
        out[i * width:(i + 1) * width] = o.squeeze(0).movedim(1, 0)
    return out


def on_cpu_engine() -> bool:
    """Whether this process runs SGLang's CPU engine (its own switch, read as SGLang reads it)."""
    import os

    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"
