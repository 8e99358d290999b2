"""Plain-torch stand-ins for what SGLang's CPU engine lacks on a PyPI install (used on CPU only, via plugin hooks).

- ``assign_req_to_token_pool``: SGLang calls sgl_kernel's ``assign_req_to_token_pool_cpu``, which the CUDA-only
  PyPI wheel does not ship; speculative KV reservation (prepare_for_decode) needs it.
- torch_native attention has no TARGET_VERIFY branch: it reads ``extend_prefix_lens`` / ``extend_seq_lens`` and
  expects ``seq_lens`` to include the new tokens, while the verify ForwardBatch (like every GPU backend expects)
  carries the committed lengths in ``seq_lens`` and B new tokens per request.
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


@contextlib.contextmanager
def torch_native_verify_lengths(forward_batch, num_tokens: int):
    """Present a TARGET_VERIFY batch to torch_native as an extend of B tokens per request on top of seq_lens."""
    bs = forward_batch.batch_size
    block = num_tokens // bs
    saved = (forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens)
    prefix = forward_batch.seq_lens
    forward_batch.extend_prefix_lens = prefix
    forward_batch.extend_seq_lens = torch.full_like(prefix, block)
    forward_batch.seq_lens = prefix + block
    try:
        yield
    finally:
        forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved
