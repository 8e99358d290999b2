"""Verification of a draft tree (draft_tree.DraftTree) against the target: which root path to keep, and the token
that follows it.

The target scored every node of the tree in one pass with the tree attention mask, so its row i (logits or
probabilities) is the target's next-token distribution after node i's path: it scores node i's children.

Both rules walk one path down from the root and return ``(commit_lens, tokens, path)``:
    commit_lens [n] int64   accepted nodes + 1 (the deepest accepted node's depth + 1)
    tokens      [n, N]      the accepted nodes' tokens then the target's own token (the next bonus); -1 after
    path        [n, N]      node indices of the kept rows, root first (path[:commit_len]: the rows whose target KV
                            and hidden states are kept); -1 after
A chain tree (draft_tree.chain_tree) gives acceptance.verify_greedy / verify_sampled's commits. No host sync.
"""

from __future__ import annotations

import torch

from .acceptance import seeded_targets
from .draft_tree import DraftTree
from .sampling import SamplingTensors, sample_from_probs


def _commit(tree: DraftTree, last: torch.Tensor, next_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of a walk that ended at node `last` [n] and then emitted `next_token` [n]: the path is last's
    ancestor row, ordered by depth (one node per depth on a root path), so one scatter places it."""
    n, size = tree.tokens.shape
    rows = torch.arange(n, device=last.device)
    on_path = tree.ancestors[rows, last]  # [n, N]
    slot = torch.where(on_path, tree.depth, size)  # off-path nodes go to a spare column, dropped below
    path = torch.full((n, size + 1), -1, dtype=torch.long, device=last.device)
    path.scatter_(1, slot, torch.arange(size, device=last.device).expand(n, size).contiguous())
    path = path[:, :size]
    commit = tree.depth[rows, last] + 1
    tokens = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)
    tokens = torch.cat([tokens[:, 1:], tokens.new_full((n, 1), -1)], 1)  # drop the root (committed last step)
    tokens = tokens.scatter(1, (commit - 1)[:, None], next_token[:, None].to(tokens.dtype))
    return commit, tokens, path


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Keep the longest root path whose every node's token equals the target's argmax at its parent; then emit the
    target's argmax at the path's end. Siblings hold distinct tokens, so at most one child of a node can match and
    the accepted nodes form one path. Output equals target-only greedy decoding token for token.
    ``target_logits`` [n, N, V] (or the argmax ids [n, N] directly)."""
    target_ids = target_logits.argmax(dim=-1) if target_logits.dim() == 3 else target_logits
    n, size = tree.tokens.shape
    rows = torch.arange(n, device=target_ids.device)
    matches = tree.tokens == target_ids.gather(1, tree.parents.clamp(min=0))
    matches[:, 0] = True  # the root is the committed bonus
    # a node is accepted iff it and all its ancestors match: no failing node on its ancestor row
    accepted = ~((~matches)[:, None, :] & tree.ancestors).any(dim=-1)
    last = torch.where(accepted, tree.depth, -1).argmax(dim=1)
    return _commit(tree, last, target_ids[rows, last])


def verify_tree_sampled(tree: DraftTree, target_probs: torch.Tensor,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """Exact speculative sampling over a deterministic draft tree (recursive rejection sampling over siblings).

    At the current node u (the root first) the target's next token must follow p_u. Its children c_1, c_2, .. (in
    node order) are point-mass candidates: try c_1 with probability p'(c_1) where p' = p_u; on rejection zero c_1's
    mass (p' becomes p_u without c_1, renormalised) and try c_2 with p'(c_2), and so on. An accepted child becomes
    u (p' restarts from its own row); when every child is rejected (or u is a leaf) the next token is drawn from p'
    and the walk ends. Each step emits x with probability p_u(x) exactly: the candidate c_j is emitted with
    prod_{i<j}(1 - p'_i(c_i)) * p'_j(c_j) = p_u(c_j), and any other token with (1 - sum_j p_u(c_j)) * p'(x) = p_u(x).

    Nodes are visited in index order, which is topological (parents[i] < i), so one loop over the nodes serves all
    requests: node i is a candidate of a request iff its parent is that request's current node. ``target_probs``
    [n, N, V] processed (greedy rows: point masses, which reduce to verify_tree_greedy)."""
    n, size, _ = target_probs.shape
    rows = torch.arange(n, device=target_probs.device)
    cur = torch.zeros(n, dtype=torch.long, device=target_probs.device)
    residual = target_probs[:, 0].clone()  # p' of the current node, unnormalised
    u = torch.rand(n, max(size - 1, 0), generator=generator, device=target_probs.device)
    for i in range(1, size):
        tok = tree.tokens[:, i]
        candidate = (tree.parents[:, i] == cur) & (tok >= 0)
        t = tok.clamp(min=0)
        mass = residual[rows, t]
        accept = candidate & (u[:, i - 1] * residual.sum(dim=-1) < mass)  # u < p'(x): p' renormalised by its sum
        residual[rows, t] = torch.where(candidate & ~accept, torch.zeros_like(mass), mass)
        residual = torch.where(accept[:, None], target_probs[:, i], residual)
        cur = torch.where(accept, i, cur)
    # the exponential race is scale-free, so the unnormalised residual samples p'; a residual left all-zero by
    # rounding (it needs p' to sit wholly on rejected children, a probability-0 event) falls back to p_u
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[rows, cur], residual)
    return _commit(tree, cur, sample_from_probs(residual, generator))


def commit_path(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix: torch.Tensor,
                path: torch.Tensor) -> None:
    """A tree step's commit in a paged KV layout (the serving worker's; pure torch, so the fused accept kernel's torch
    twin, kernels/tree_accept.py, uses it too). Commit the accepted path (tree_acceptance's ``path`` [bs, N]: node indices root first, -1 after the commit):
    req_to_token[req, prefix : prefix + N] is permuted in place so that column prefix + j holds path node j's slot
    (j < commit_len), the other nodes' slots after it in node order. Same slots per row; other rows untouched."""
    bs, n = path.shape
    dev = path.device
    cols = prefix.to(torch.int64)[:, None] + torch.arange(n, device=dev)
    rows = req_pool_indices.to(torch.int64)[:, None].expand(bs, n)
    slots = req_to_token[rows, cols]
    # rank of node i in the new order: its place on the path, else N + i (behind the path, in node order); the
    # path's -1 entries scatter into a spare column N, dropped
    rank = (torch.arange(n + 1, device=dev) + n).expand(bs, n + 1).contiguous()
    rank.scatter_(1, torch.where(path >= 0, path, n), torch.arange(n, device=dev).expand(bs, n).contiguous())
    order = rank[:, :n].argsort(dim=1)  # keys are distinct: one permutation per row
    req_to_token[rows, cols] = slots.gather(1, order)


def verify_tree_seeded(tree: DraftTree, target_logits: torch.Tensor, s: SamplingTensors, seeds: torch.Tensor,
                       prefix: torch.Tensor, filtered: bool = True) -> tuple[torch.Tensor, ...]:
    """acceptance.verify_seeded over a tree: the target's seeded sample X_i at every node (row i sits at position
    prefix + depth_i, so nodes of one depth share their position's noise: only one of them is ever on the walk),
    then ``verify_tree_greedy`` against X. The emitted tokens are the seeded target-only stream, as in the chain;
    a node is kept with probability P(X_parent = its token) = p_parent(token), verify_tree_sampled's total.
    ``target_logits`` [n, N, V]; ``s`` / ``seeds`` / ``prefix`` [n] one row per request."""
    positions = prefix.to(torch.int64)[:, None] + tree.depth
    return verify_tree_greedy(tree, seeded_targets(target_logits, s, seeds, positions, filtered))
