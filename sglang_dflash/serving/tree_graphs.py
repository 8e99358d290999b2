"""Tree steps under CUDA graphs (SGLANG_DFLASH_TREE, issue #38 items 1 and 2): the tree in static buffers.

A tree step (tree_step.py) is draft -> tree build -> target verify under the tree mask -> accept. Run eagerly, the
build is N-1 batched torch steps and the verify one eager forward of the target (its attention metadata planned on
the host, every layer launched): on an H100 a 16-node tree step cost 3.7-5.8 chain steps
(benchmarks/results/tree-h100). Here both are replayed from CUDA graphs:

    build   the draft CUDA graph's tail (worker._capture_draft_head, a capture tail hook of the draft runner)
            records tree_step.tree_of_logits and ``TreeBuffers.store``: a draft replay leaves the step's tree, its
            verify inputs (ids, positions prefix + depth, KV slots) and the kernel's tree mask in ``TreeBuffers``
    verify  ``TreeVerifyGraphs``: the target's TARGET_VERIFY graphs at width N, captured at start-up with their
            own graph runner and attention backend (as verify_widths.py captures extra chain widths) while
            tree_step.active() held a TreeVerify whose kernel mask IS the static buffers, so every captured
            attention launch reads the mask from there; a replay reads whatever the step stored

Why the verify graphs need nothing else: SGLang 0.5.17's DecodeCudaGraphRunner.load_batch copies the batch's
input_ids, positions (our spec_info.positions: prefix + depth), out_cache_loc, req_pool_indices and seq_lens into its
own static buffers (cuda_graph_buffer_registry.build_decode_registry) and re-plans the triton backend's verify
metadata (qo_indptr = arange * N from spec_info.draft_token_num, the prefix's kv indices from seq_lens;
verify_metadata.py's hook). The block's own K/V reach the kernel as k_extend, masked by the tree bits and placed at
the stored depths. The draft context commit (context_commit.py) runs inside the verify forward, so it is captured
too: it writes every node's context K/V at the node's slot (out_cache_loc) and position (positions).

Costs: the tree head runs in every draft replay of its batch sizes, so a tree server's chain steps (batches a tree
step does not serve: sampled, penalties, grammar, ...) pay it too (N-1 small batched steps, graphed); the tree
verify graphs are one more set of target graphs (memory logged at start-up).

Pad rows (a batch padded up to a captured size) read rows [bs, padded) of the buffers: the causal chain they start
with, or a tree an earlier step (or a draft replay's own pad rows) left there. Every such row is a valid tree mask
(its own bit set, depths < N), and a pad row's outputs are dropped and its K/V land in the pool's dummy slot 0, so
none of them can reach a real row. Batches larger than the captured sizes keep the eager step.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..draft_tree import DraftTree
from . import tree_step

logger = logging.getLogger("sglang_dflash")


class TreeBuffers:
    """One tree per request row, in buffers allocated once for ``max_bs`` rows: rows [:bs] are the current step's.

    tokens, parents, depth [max_bs, N] int64; ancestors [max_bs, N, N] bool; log_prob [max_bs, N] float32 (a
    DraftTree's fields); ids, positions, cache_loc [max_bs, N] int64 (tree_step.verify_inputs); bits [max_bs * N]
    int64, kernel_depth [max_bs * N] int32 (TreeVerify.kernel_mask, what the verify kernel reads)."""

    def __init__(self, max_bs: int, size: int, device):
        self.max_bs, self.size = max_bs, size
        n, dev = size, device
        node = torch.arange(n, device=dev)
        # start as the causal chain, a valid tree for every row that a pad row may read before any step wrote it
        self.tokens = torch.zeros((max_bs, n), dtype=torch.int64, device=dev)
        self.parents = (node - 1).expand(max_bs, n).contiguous()
        self.depth = node.expand(max_bs, n).contiguous()
        self.ancestors = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(max_bs, n, n).contiguous()
        self.log_prob = torch.zeros((max_bs, n), dtype=torch.float32, device=dev)
        self.ids = torch.zeros((max_bs, n), dtype=torch.int64, device=dev)
        self.positions = torch.zeros_like(self.ids)
        self.cache_loc = torch.zeros_like(self.ids)
        self.bits = ((2 << node) - 1).repeat(max_bs)  # causal: node i sees nodes 0..i
        self.kernel_depth = node.to(torch.int32).repeat(max_bs)

    def store(self, tree: DraftTree, prefix: torch.Tensor, req_pool_indices: torch.Tensor,
              req_to_token: torch.Tensor) -> None:
        """Rows [:bs] := ``tree`` of bs requests, its verify inputs and its kernel mask. Tensor ops and copies only
        (no host sync, fixed shapes): the draft graph's tail records it, and an eager build calls it too."""
        bs, n = tree.tokens.shape
        if n != self.size or bs > self.max_bs:
            raise ValueError(f"a tree of {bs} x {n} nodes does not fit the static buffers "
                             f"({self.max_bs} x {self.size})")
        ids, positions, cache_loc = tree_step.verify_inputs(tree, prefix, req_pool_indices, req_to_token)
        bits, kernel_depth = tree_step.kernel_mask(tree)
        for dst, src in ((self.tokens, tree.tokens), (self.parents, tree.parents), (self.depth, tree.depth),
                         (self.ancestors, tree.ancestors), (self.log_prob, tree.log_prob), (self.ids, ids),
                         (self.positions, positions), (self.cache_loc, cache_loc)):
            dst[:bs].copy_(src)
        self.bits[:bs * n].copy_(bits)
        self.kernel_depth[:bs * n].copy_(kernel_depth)

    def tree(self, bs: int) -> DraftTree:
        return DraftTree(self.tokens[:bs], self.parents[:bs], self.depth[:bs], self.ancestors[:bs],
                         self.log_prob[:bs])

    def verify_inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ids[:bs], self.positions[:bs], self.cache_loc[:bs]

    def verify(self, bs: int) -> tree_step.TreeVerify:
        """The TreeVerify of rows [:bs], its kernel mask views of the static buffers (from their first element: the
        pointer a captured kernel launch holds)."""
        n = self.size
        return tree_step.TreeVerify(n, self.depth[:bs], self.ancestors[:bs], self.parents[:bs].reshape(-1),
                                    (self.bits[:bs * n], self.kernel_depth[:bs * n]))


class TreeVerifyGraphs:
    """The target's TARGET_VERIFY CUDA graphs at the tree's width N, reading the tree mask from ``buffers``."""

    def __init__(self, model_runner, buffers: TreeBuffers):
        self.model_runner, self.buffers = model_runner, buffers
        self.runner = self.backend = None
        self.graph_memory_gb = 0.0

    def capture(self) -> None:
        """Capture at start-up (after SGLang's own verify graphs): one graph per captured batch size, with this
        object's own attention backend (its graph-metadata buffers are bound into these graphs)."""
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        from sglang.srt.utils import get_available_gpu_memory

        mr, n = self.model_runner, self.buffers.size
        if mr.decode_cuda_graph_runner is None:
            logger.info("sglang-dflash: the target has no verify CUDA graphs, so tree verifies run eagerly")
            return
        t0, before = time.perf_counter(), get_available_gpu_memory(mr.device, mr.gpu_id)
        backend = mr._get_attention_backend()
        # every attention call of the captured forwards takes the tree from here: its kernel mask is the buffers
        with tree_step.verifying(self.buffers.verify(self.buffers.max_bs)):
            runner = DecodeCudaGraphRunner(mr, attn_backend=backend, speculative_num_draft_tokens=n)
        if runner.max_bs > self.buffers.max_bs:  # a captured pad row would read past the mask buffers
            raise RuntimeError(f"tree verify graphs captured up to bs {runner.max_bs}, but the tree buffers hold "
                               f"{self.buffers.max_bs} rows (sglang_dflash/serving/tree_graphs.py)")
        self.runner, self.backend = runner, backend
        self.graph_memory_gb = before - get_available_gpu_memory(mr.device, mr.gpu_id)
        logger.info("sglang-dflash: captured tree verify graphs at width %d (bs %s) in %.1f s, %.2f GB", n,
                    list(runner.capture_bs), time.perf_counter() - t0, self.graph_memory_gb)

    def fits(self, bs: int) -> bool:
        """Whether a tree verify of bs requests replays a graph (SGLang's own rule: padded up to a captured size,
        or an exact captured size with --disable-cuda-graph-padding)."""
        runner = self.runner
        if runner is None:
            return False
        return bs in runner.capture_bs if runner.disable_padding else bs <= runner.max_bs

    @contextlib.contextmanager
    def target(self):
        """Within this block the target's model runner verifies with the tree graphs and their backend."""
        mr = self.model_runner
        saved = mr.decode_cuda_graph_runner, mr.attn_backend
        mr.decode_cuda_graph_runner, mr.attn_backend = self.runner, self.backend
        try:
            yield
        finally:
            mr.decode_cuda_graph_runner, mr.attn_backend = saved


def capture_sizes(model_runner, width: int) -> list[int]:
    """The batch sizes SGLang's decode graph runner captures at ``width`` tokens per request (its own function)."""
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture

    return list(get_batch_sizes_to_capture(model_runner, width)[0])
