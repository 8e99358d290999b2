"""Tree verify inside the serving worker (issue #38 item 3): the tree-specific parts of a decode step.

With ``SGLANG_DFLASH_TREE=N`` a qualifying decode step (``applies``) verifies a draft tree of N nodes instead of the
chain [bonus, d_1..d_{B-1}], spending the same drafter pass on several paths at once (the algorithm and why it is
the best tree under the drafter's own model: ``sglang_dflash/draft_tree.py``; the reference engine runs the same
steps on plain torch, ``reference/engine.py: ReferenceEngine._tree_step``). One step:

    draft   the chain step's drafter pass; its hidden rows of block positions 1..B-1 through the target's lm_head
            (``build_tree``) -> draft_tree.build_draft_tree: N nodes, root = the bonus; on the GPU recorded into
            the draft CUDA graph (tree_graphs.py), eager where a batch size's draft graph has no tree head
    verify  one target pass over the N nodes (``verify_inputs``): node i at position prefix + depth_i, in KV slot
            req_to_token[req, prefix + i] (a slot the request owns: the scheduler reserves committed + 2B per
            request, and N <= B), attention under the tree mask (``TreeVerify``, read by the attention hooks:
            cpu_ops.verify_attention on CPU, kernels/verify_attention.py's tree mode on GPU); a replay of the
            tree verify CUDA graphs (tree_graphs.py), eager (``eager``) without them or past their batch sizes
    accept  tree_acceptance.verify_tree_greedy -> commit_lens, tokens, path (the tree rows to keep); a batch with
            sampled rows: verify_tree_sampled on the target's processed probabilities per node (the chain's
            sampled path's, sampling.processed_probs), exact for greedy rows too (point masses)
    commit  ``tree_acceptance.commit_path``: permute req_to_token[req, prefix : prefix + N] so the path's slots come first
            (on the GPU a greedy batch's accept, commit and outputs are one launch, kernels/tree_accept.py, whose
            torch twin, the CPU path, is these two functions and greedy_accept.commit_outputs; a sampled batch
            runs the same functions with verify_tree_sampled, in torch on either device)

Why the commit is a permutation and not a KV copy: the verify forward already wrote, at every node's slot, the
target's K/V and (context_commit.py, inside the same forward) the drafter's context K/V, both computed at the
node's position prefix + depth. Path node j has depth j, so its rows are exactly the rows a chain commit would have
written at position prefix + j; moving its slot to column prefix + j of req_to_token commits it. The request keeps
owning the same set of slots (what the scheduler frees or caches is still its own), the rejected nodes' slots
move behind the path, and the next step's block, which starts at the new length, rewrites them before anything
reads them (as with a chain's rejected rows). Page size 1 only: a paged pool ties a slot to its position's page
(refused at start-up, startup.check_tree).

Why the tree is passed to the attention through a module-level context (``verifying`` / ``active``): SGLang calls
the attention backend deep inside the target model's forward with a ForwardBatch it builds itself; the tree is
state of one forward, so the worker sets it around exactly that call (and the tree graphs' capture around theirs)
and the two hooks (the CPU torch_native hook in plugin.py, the GPU triton hook in verify_kernel.py) read it. Outside
a tree verify it is None, and every other TARGET_VERIFY forward (the chain's, the drafter's block pass) is untouched.
The hooks check that the batch's width is the tree's size.

Graphs: the chain's verify CUDA graphs (SGLang's at width B, ours at the adaptive widths) were captured without a
tree mask, so replaying one would attend causally over the block. Tree steps replay their own graphs, captured
while ``active()`` held a TreeVerify whose kernel mask lives in static buffers (tree_graphs.py: what is captured,
what a replay copies). Where none applies (CPU, --disable-cuda-graph, a batch past the captured sizes) the verify
runs eagerly: ``eager`` hides the graph runner from the model runner for that one forward, which makes SGLang's own
``prepare_for_verify`` plan eager attention metadata and ``ModelRunner.forward`` run the model eagerly.

No host synchronisation: every function here is tensor ops on the step's device tensors (the tree is built by
N-1 batched steps; its shapes depend on N and B only), and ``build_tree`` / ``verify_inputs`` / ``kernel_mask``
are CUDA-graph capturable.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..draft_tree import DraftTree, build_draft_tree



@dataclass
class TreeVerify:
    """The tree of one verify forward, as the attention hooks read it (bs requests, N nodes each, block-local):

    depth     [bs, N] int64  node i sits at position prefix + depth[:, i]
    ancestors [bs, N, N] bool  row i: the block keys node i may see (its ancestors and itself)
    parents   [bs * N] int64 block-local parent per verify token (root -1)
    kernel_mask  (bits [bs * N] int64, depth [bs * N] int32): the GPU kernel's tree mode input (``tree_mask``), bit j
              of node i set when node j is an ancestor of i or i itself; built once here, for every layer's call
    reads     how many attention calls applied the tree (``claim``): the worker checks that some did, so an
              attention path that ignores the tree fails the step instead of attending causally over the nodes
    replayed  set when the forward was a CUDA-graph replay (tree_graphs.py): no Python runs in a replay, so no call
              claims the tree; the captured calls did, with this mask's static buffers"""

    size: int
    depth: torch.Tensor
    ancestors: torch.Tensor
    parents: torch.Tensor
    kernel_mask: tuple[torch.Tensor, torch.Tensor]
    reads: int = 0
    replayed: bool = False

    @classmethod
    def of(cls, tree: DraftTree) -> TreeVerify:
        return cls(tree.size, tree.depth, tree.ancestors, tree.parents.reshape(-1).contiguous(), kernel_mask(tree))

    def claim(self, width: int) -> TreeVerify:
        """An attention hook takes the tree for a batch of ``width`` tokens per request (must be the tree's size)."""
        if width != self.size:
            raise RuntimeError(f"a tree verify of {self.size} nodes reached the attention as a batch of width "
                               f"{width}: the tree and the batch disagree (sglang_dflash/serving/tree_step.py)")
        self.reads += 1
        return self


_active: TreeVerify | None = None


def active() -> TreeVerify | None:
    """The tree of the target verify forward running now, or None (chain verifies, draft passes, everything else)."""
    return _active


@contextlib.contextmanager
def verifying(tree: TreeVerify):
    """Within this block the target's TARGET_VERIFY attention applies ``tree``'s mask and depths."""
    global _active
    if _active is not None:
        raise RuntimeError("nested tree verifies")
    _active = tree
    try:
        yield tree
    finally:
        _active = None
    if tree.reads == 0 and not tree.replayed:
        raise RuntimeError("a tree verify ran without any attention layer applying the tree mask: the target's "
                           "attention backend is not one the tree hooks serve (CPU: torch_native; GPU: triton with "
                           "our verify kernel). Fix: use that backend, or SGLANG_DFLASH_TREE=0")


@contextlib.contextmanager
def eager(model_runner):
    """Within this block the target's model runner has no decode CUDA graph runner: the verify's metadata is
    planned eagerly (DFlashVerifyInput.prepare_for_verify) and ModelRunner.forward runs the model eagerly. The
    chain's verify graphs carry no tree mask (module doc); a tree step without tree graphs of its size takes this."""
    saved = model_runner.decode_cuda_graph_runner
    model_runner.decode_cuda_graph_runner = None
    try:
        yield
    finally:
        model_runner.decode_cuda_graph_runner = saved


def applies(batch) -> bool:
    """Whether this decode batch may take a tree step: no per-request control that needs per-row state along the
    drafted path (penalties / min_new_tokens, grammar, logit_bias: controls.py applies them along a chain; a tree
    would need their state per node) and no logprobs (the chain's output layout). Greedy and sampled rows
    (temperature, top-k, top-p, min-p) both qualify: the worker accepts an all-greedy batch (``all_greedy``) with
    the greedy tree rule and any other with the exact sampled one (tree_acceptance.verify_tree_sampled; greedy
    rows are point masses there). Host-side flags SGLang already holds: no sync, no pass over the requests."""
    info = batch.sampling_info
    if info is not None:
        if info.logit_bias is not None:
            return False
        if info.acc_additive_penalties is not None or getattr(info, "acc_scaling_penalties", None) is not None:
            return False
    return not getattr(batch, "has_grammar", False) and not batch.return_logprob


def all_greedy(batch) -> bool:
    """Whether every request of the batch decodes greedily, so a tree step may take the greedy rule (one launch on
    the GPU, kernels/tree_accept.py) instead of the sampled one. SGLang's ``is_all_greedy`` is sticky (merging a
    sampled request clears it, and filtering the request out does not set it again), so when it is off the
    requests' own settings decide (SGLang encodes greedy as top_k = 1): one host pass over the batch's requests, no
    device read. (The sampled rule would give greedy rows the same tokens, at the cost of the dense probabilities.)"""
    info = batch.sampling_info
    return info is None or info.is_all_greedy or all(r.sampling_params.top_k == 1 for r in batch.reqs)


def build_tree(draft_model, hidden: torch.Tensor, anchors: torch.Tensor, size: int) -> DraftTree:
    """The step's draft tree from its drafter pass: ``hidden`` [bs * (B-1), H] final draft hidden rows of block
    positions 1..B-1, ``anchors`` [bs] the bonus tokens. The draft logits are the chain's draft head's
    (draft_model.draft_logits: the target's lm_head, output multiplier, softcap), over the vocabulary's own rows
    (lm_head padding rows dropped); --tp-size 1 (refused otherwise at start-up), so the rank holds them all."""
    return tree_of_logits(draft_model, draft_model.draft_logits(hidden), anchors, size)


def tree_of_logits(draft_model, logits: torch.Tensor, anchors: torch.Tensor, size: int) -> DraftTree:
    """``build_tree`` from the draft logits [bs * (B-1), lm_head rows] (the draft graph's tail computes them once
    for both heads). Capturable in a CUDA graph (draft_tree's module doc)."""
    bs = anchors.shape[0]
    start, rows = draft_model.vocab.head_rows
    return build_draft_tree(anchors, logits[:, start:start + rows].view(bs, -1, rows), size)


def kernel_mask(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify kernel's tree mode input of ``tree`` (kernels/verify_attention.tree_ancestor_bits' layout): bits
    [bs * N] int64 (bit j of node i: j is an ancestor of i, or i itself) and depth [bs * N] int32."""
    columns = torch.arange(tree.size, device=tree.ancestors.device)
    bits = (tree.ancestors.long() << columns).sum(-1).reshape(-1)  # N <= B <= 32 nodes: fits an int64
    return bits, tree.depth.reshape(-1).to(torch.int32)


def verify_inputs(tree: DraftTree, prefix: torch.Tensor, req_pool_indices: torch.Tensor,
                  req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, cache_loc), each [bs, N] int64, of the tree verify: node i's token (a DEAD node, token -1,
    is fed as 0: its row is scored but never accepted, and only itself attends to it), its position
    prefix + depth_i, and its KV slot req_to_token[req, prefix + i]."""
    n = tree.size
    ids = tree.tokens.clamp(min=0)
    prefix = prefix.to(torch.int64)[:, None]
    positions = prefix + tree.depth
    cols = prefix + torch.arange(n, device=prefix.device)
    cache_loc = req_to_token[req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)
    return ids, positions, cache_loc
