"""Compile, before the server reports healthy, the Triton kernels of SGLang that a speculative server would otherwise
compile on the request path (issue #34 item 1, the time to first token).

Measured on an H100 (Qwen3-8B shape, ``benchmarks/results/ttft-probe-h100``, ``benchmarks/ttft_probe.py``): the
first prefill batch of 8 new requests answered in 208 ms and the same batch again in 82 ms; 7 short prompts 378 vs
72 ms; 16 requests 198 vs 97 ms. Every one of those first times compiled a Triton kernel of SGLang's, and plain
decoding compiled none:

- ``assign_req_to_token_pool`` (``mem_cache/allocation.py``) writes the KV slots that speculative decoding reserves
  ahead (``alloc_for_spec_decode``, committed + 2B per request) into ``req_to_token``. It takes
  ``next_power_of_2(batch size)`` as a ``tl.constexpr``, so each new power of two is a new kernel;
- ``write_req_to_token_pool_triton`` (``kernels/ops/memory/common.py``) does the same for a prefill.

Both are also specialised on whether each pointer argument is 16-byte aligned, and the KV allocator hands out
slices of its free list at any offset, so one batch size can meet two variants. A first compile costs ~100-300 ms,
paid by the time to first token of the first batch of each new size (``bench``'s c = 8 level: 1.9x plain's TTFT
p50 in one run, with its first round of requests in one such batch).

This runs both kernels once per variant with nothing to write (zero-length ranges), on the server's own
``req_to_token`` (its row length is a constexpr of both kernels) and with the argument dtypes SGLang's callers use
(``DFlashDraftInputV2.prepare_for_decode``, ``alloc_for_extend``), so the compiles happen at start-up instead. It
writes nothing. It is a cache warm-up of SGLang's own functions, not a change to them.

With tree verify on (``SGLANG_DFLASH_TREE=N``, issue #48 item 2), our greedy tree accept (``kernels/tree_accept.py``)
is compiled here too: it runs after the verify, outside every CUDA graph, so nothing else compiles it before the first
tree step. The tree's other work needs no warm-up: the tree build and its mask are torch ops, and the verify kernel's
tree mode is compiled when the tree verify graphs are captured (an eager-only server compiles every kernel on first
use, the chain's as well).
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("sglang_dflash")


def _aligned_and_not(n: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Two zero tensors of n elements: one 16-byte aligned, one at an 8-byte offset (Triton's two variants)."""
    base = torch.zeros(n + 2, dtype=dtype, device=device)
    return [base[:n], base[1:n + 1]]


def warm_kv_slot_kernels(req_to_token: torch.Tensor, max_batch: int) -> int:
    """Compile SGLang's two req_to_token writers for every power of two up to max_batch and both alignments of the
    slots tensor; returns the number of launches (each a no-op). CUDA only: CPU servers have no Triton path here."""
    if req_to_token.device.type != "cuda":
        return 0
    from sglang.kernels.ops.memory.common import write_req_to_token_pool_triton
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    dev, t0, launches = req_to_token.device, time.perf_counter(), 0
    bs = 1
    while True:
        rows = torch.zeros(bs, dtype=torch.int64, device=dev)  # ScheduleBatch.req_pool_indices
        lens = torch.zeros(bs, dtype=torch.int32, device=dev)  # prepare_for_decode's cur / next KV lengths
        for slots in _aligned_and_not(bs, torch.int64, dev):  # start = end: no slot is written
            assign_req_to_token_pool_func(rows, req_to_token, lens, lens, slots, bs)
            launches += 1
        if bs >= max_batch:
            break
        bs *= 2
    # a prefill's writer: no power-of-two constexpr, only the alignments (prefix and extend lengths 0: no writes)
    zeros = torch.zeros(1, dtype=torch.int64, device=dev)
    prefix_pointers = torch.tensor([zeros.data_ptr()], dtype=torch.uint64, device=dev)
    for slots in _aligned_and_not(1, torch.int64, dev):
        write_req_to_token_pool_triton[(1,)](req_to_token, zeros, prefix_pointers, zeros, zeros, zeros, slots,
                                             req_to_token.shape[1])
        launches += 1
    torch.cuda.synchronize(dev)
    logger.info("sglang-dflash: compiled SGLang's KV-slot kernels for batches up to %d ahead of serving (%d variants, "
                "%.1f s): a first batch of a new size no longer compiles them on its time to first token",
                max_batch, launches, time.perf_counter() - t0)
    return launches


def tree_accept_warmup_args(tree_size: int, req_to_token: torch.Tensor) -> tuple | None:
    """The arguments of one ``tree_accept`` launch that compiles the variant every tree step of this server uses, or
    None with trees off (tree_size 0). Triton keys a variant on the constexprs (BLOCK = next_power_of_2(N), at least
    16), the tensors' dtypes and 16-byte alignment, and whether each integer argument is 1 or a multiple of 16; the
    batch size is only the grid. So: a chain tree of N nodes in the dtypes a step passes (the tree int64 with a bool
    ancestor mask, the argmax ids int64, SGLang's seq_lens and req_pool_indices int64), fresh (aligned) tensors as a
    step's are, and a scratch row of the pool's dtype and row stride (the kernel's r2t_stride), so the launch
    writes no row the server reads. Any device: CPU tests compare it with a step's launch."""
    if not tree_size:
        return None
    from ..draft_tree import chain_tree

    dev = req_to_token.device
    scratch = torch.zeros(1, req_to_token.stride(0), dtype=req_to_token.dtype, device=dev)
    prefix = torch.zeros(1, dtype=torch.int64, device=dev)  # ScheduleBatch.seq_lens
    tree = chain_tree(prefix, torch.zeros(1, tree_size - 1, dtype=torch.int64, device=dev))
    return torch.zeros(1, tree_size, dtype=torch.int64, device=dev), tree, prefix, prefix.clone(), scratch


def warm_tree_accept(tree_size: int, req_to_token: torch.Tensor) -> bool:
    """Compile the greedy tree accept (kernels/tree_accept.py) at start-up instead of on the first tree step's
    latency (issue #48): one launch on ``tree_accept_warmup_args``. CUDA only (CPU servers run its torch twin), and
    only with SGLANG_DFLASH_TREE on; returns whether it ran."""
    args = tree_accept_warmup_args(tree_size, req_to_token) if req_to_token.device.type == "cuda" else None
    if args is None:
        return False
    from ..kernels.tree_accept import tree_accept

    t0 = time.perf_counter()
    tree_accept(*args)
    torch.cuda.synchronize(req_to_token.device)
    logger.info("sglang-dflash: compiled the tree accept kernel for trees of %d nodes ahead of serving (%.1f s)",
                tree_size, time.perf_counter() - t0)
    return True
