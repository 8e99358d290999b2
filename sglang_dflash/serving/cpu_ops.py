"""Plain-torch stand-ins for what SGLang's CPU engine lacks on a PyPI install (used on CPU only, via plugin hooks).

- ``assign_req_to_token_pool``: SGLang calls sgl_kernel's ``assign_req_to_token_pool_cpu``, which the CUDA-only
  PyPI wheel does not ship; speculative KV reservation (prepare_for_decode) needs it.
- torch_native attention has no TARGET_VERIFY branch: it reads ``extend_prefix_lens`` / ``extend_seq_lens`` and
  expects ``seq_lens`` to include the new tokens, while the verify ForwardBatch (like every GPU backend expects)
  carries the committed lengths in ``seq_lens`` and B new tokens per request.
- ``StreamlessIndices``: overlap scheduling calls ``record_stream`` on the FutureMap's index tensor; that op exists
  for CUDA tensors only. On CPU there are no streams, so recording one is a no-op.
"""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def torch_native_verify_lengths(forward_batch):
    """Present a TARGET_VERIFY batch to torch_native as an extend of B tokens per request on top of seq_lens.

    B comes from the batch (its spec_info's ``draft_token_num``, else tokens / requests), never from the shape of
    q: model classes hand attention q in different layouts (Gemma-3 passes [1, N, heads, dim]).
    """
    bs = forward_batch.batch_size
    n = forward_batch.positions.numel()
    block = getattr(forward_batch.spec_info, "draft_token_num", None) or n // bs
    if block * bs != n:
        raise RuntimeError(f"TARGET_VERIFY batch of {bs} requests x block {block} != {n} positions")
    saved = (forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens)
    prefix = forward_batch.seq_lens
    forward_batch.extend_prefix_lens = prefix
    forward_batch.extend_seq_lens = torch.full_like(prefix, block)
    forward_batch.seq_lens = prefix + block
    try:
        yield
    finally:
        forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved


def on_cpu_engine() -> bool:
    """Whether this process runs SGLang's CPU engine (its own switch, read as SGLang reads it)."""
    import os

    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"
