"""Draft trees from one DFlash drafter pass: the N most probable paths through the per-position top-k drafts.

A DFlash drafter scores every block position 1..B-1 in one parallel pass, each position conditioned only on the
block's anchor (the bonus token) and the context, never on the tokens drafted before it. So one pass gives B-1
independent distributions q_1..q_{B-1}, and a path of tokens (x_1..x_d) gets the draft score
prod_j q_j(x_j). The chain of plain DFlash is the one path of each position's argmax; a tree spends the same
verify pass on several paths at once.

Construction (best-first by path probability, depth limit B-1). Node 0 is the root, the anchor itself (it is the
first verify row, as in the chain). The children of any node at depth d are the top-k tokens of q_{d+1} in rank
order (all nodes at one depth share their candidates, as the drafter cannot condition on the parent). Starting
from the root, we repeatedly pop the frontier entry of highest path probability and add it as the next node;
popping a node pushes two successors: its first child (rank 0 at depth d+1) and its next sibling (rank r+1 under
the same parent). Path probability never increases along either successor, so the pops come out in
non-increasing order and the tree is exactly the N-1 most probable paths (prefix-closed: a prefix is at least as
probable as its extension; ties broken by pop order). The frontier gains at most one entry per pop, so it has
at most N slots; the N-1 pops run batched over requests (a loop of N-1 small tensor steps, no per-request Python).

Why this choice: under the draft's own model (positions independent), the expected number of accepted nodes of a
tree is the sum of its nodes' path probabilities, so for a budget of N nodes the N-1 most probable paths are the
best tree that model can name, and best-first finds them without scoring the V^(B-1) others. The chain is the
most probable path of each depth, but best-first may spend the budget on shallow near-ties instead of reaching
depth B-1: a tree of N = B nodes is the chain only when every position's argmax dominates. DFlash's drafts are not
calibrated (and the target is not independent across positions), so "best" holds for the draft's model, not the
target's: benchmarks/tree_tau.py measures what it buys.

Terms and shapes (n requests, N nodes including the root, B the block size):
    tokens   [n, N] int64   node i's token (root: the anchor)
    parents  [n, N] int64   parent node index (root: -1); parents[i] < i, so nodes are in topological order
    depth    [n, N] int64   0 for the root, 1..B-1 (node i drafts block position depth[i], token position
                            anchor position + depth[i])
    ancestors [n, N, N] bool  row i: node i's ancestors and itself (the tree attention mask of the verify block)
    log_prob [n, N] float32  log of the path's draft probability (root 0; -inf for a DEAD node)
A chain of B is the tree with parents = i - 1: `chain_tree`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEAD = -1  # the token of a node the frontier could not fill (see build_draft_tree)


@dataclass
class DraftTree:
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    log_prob: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n, N] parent indices (topological: parents[i] < i, root -1) -> [n, N, N] bool, row i = ancestors of i and i.
    One batched step per node: row i = row parents[i] plus i itself."""
    n, size = parents.shape
    rows = torch.arange(n, device=parents.device)
    mask = torch.eye(size, dtype=torch.bool, device=parents.device).expand(n, size, size).clone()
    for i in range(1, size):
        mask[:, i] |= mask[rows, parents[:, i].clamp(min=0)] & (parents[:, i] >= 0)[:, None]
    return mask


def chain_tree(anchor: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """The chain [anchor, d_1..d_{B-1}] as a tree (each node the child of the one before): the plain DFlash block."""
    n, b = drafts.shape[0], drafts.shape[1] + 1
    idx = torch.arange(b, device=drafts.device)
    parents = (idx - 1).expand(n, b).contiguous()
    return DraftTree(torch.cat([anchor[:, None], drafts], 1), parents, idx.expand(n, b).contiguous(),
                     ancestor_mask(parents), torch.zeros(n, b, device=drafts.device))


def build_draft_tree(anchor: torch.Tensor, draft_logits: torch.Tensor, size: int) -> DraftTree:
    """The best-first draft tree of `size` nodes (root included) from one block's draft logits.

    ``anchor`` [n] the bonus tokens, ``draft_logits`` [n, B-1, V] the drafter's logits at block positions 1..B-1
    (any float dtype). Returns a DraftTree whose nodes are the size-1 most probable paths under prod_j q_j (see the
    module doc); log-probabilities in float32."""
    n, depth_limit, vocab = draft_logits.shape
    if size < 1:
        raise ValueError(f"tree size {size}: must be >= 1 (the root)")
    dev = draft_logits.device
    k = max(1, min(size - 1, vocab))  # no node can have more than size - 1 children
    top_lp, top_id = torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)  # [n, B-1, k], rank order
    rows = torch.arange(n, device=dev)
    # constants as device tensors: a Python scalar in torch.where or an indexed write is a 0-dim CPU tensor that the
    # op copies to the device, a host copy a CUDA graph capture refuses
    neg = torch.full((), -torch.inf, device=dev)
    dead = torch.full((), DEAD, dtype=torch.long, device=dev)
    one, zero = torch.ones((), dtype=torch.long, device=dev), torch.zeros((), dtype=torch.long, device=dev)

    tokens = torch.full((n, size), -1, dtype=torch.long, device=dev)
    parents = torch.full_like(tokens, -1)
    depth = torch.zeros_like(tokens)
    log_prob = torch.zeros(n, size, device=dev)
    tokens[:, 0] = anchor
    # the frontier: one slot per candidate node (score, parent, depth, rank); an empty slot scores -inf. It starts
    # with the root's first child and gains at most one slot per pop.
    f_score = torch.full((n, size), -torch.inf, device=dev)
    f_parent = torch.zeros(n, size, dtype=torch.long, device=dev)
    f_depth = torch.ones_like(f_parent)
    f_rank = torch.zeros_like(f_parent)
    if depth_limit > 0:
        f_score[:, 0] = top_lp[:, 0, 0]
    for node in range(1, size):
        best = f_score.argmax(dim=1)  # first index on ties: deterministic
        score, par, d, r = f_score[rows, best], f_parent[rows, best], f_depth[rows, best], f_rank[rows, best]
        # a row whose frontier ran dry (fewer paths of probability > 0 than nodes) gets DEAD nodes: token -1, which
        # no acceptance rule accepts (the engine feeds the target a valid id in their place; nothing reads them)
        live = torch.isfinite(score)
        d = torch.where(live, d, one)  # an empty slot may carry depth limit + 1: keep the gathers in range
        tokens[:, node] = torch.where(live, top_id[rows, d - 1, r], dead)
        parents[:, node] = torch.where(live, par, zero)
        depth[:, node] = d
        log_prob[:, node] = torch.where(live, score, neg)
        # successor 1 replaces the popped slot: the new node's first child, one level deeper
        deeper = d < depth_limit
        dc = d.clamp(max=depth_limit - 1)
        f_score[rows, best] = torch.where(live & deeper, score + top_lp[rows, dc, 0], neg)
        f_parent[rows, best], f_depth[rows, best] = torch.full_like(par, node), d + 1
        f_rank[rows, best] = zero.expand(n)
        # successor 2 takes a fresh slot: the popped node's next sibling (same parent, next rank at its depth)
        more = r + 1 < k
        rn = (r + 1).clamp(max=k - 1)
        sib = score - top_lp[rows, d - 1, r] + top_lp[rows, d - 1, rn]
        f_score[:, node] = torch.where(live & more, sib, neg)
        f_parent[:, node], f_depth[:, node], f_rank[:, node] = par, d, rn
    return DraftTree(tokens, parents, depth, ancestor_mask(parents), log_prob)
