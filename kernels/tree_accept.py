"""A greedy tree verify's accept, commit and step outputs in one launch.

After the target's verify pass over a draft tree (draft_tree.DraftTree, ``N`` nodes, root = the bonus), a greedy
tree step needs, per request ``r`` (``t`` = the target's argmax ids ``[bs, N]``: row i scores node i's children)::

    accepted node i   every node on its root path matches: tokens[j] == t[parents[j]] (the root always matches)
    last              the deepest accepted node; path = last's ancestors ordered by depth (one per depth)
    commit_lens[r]    depth[last] + 1                   (int64; SGLang's accept_lens = the same as int32)
    tokens[r, k]      t[path[k]] if k < commit_lens[r], else -1   (the accepted tokens, then the bonus t[last])
    req_to_token[q_r, prefix_r + k] := path node k's slot for k < commit_lens[r], then the other nodes' in node order
    next_ids, bonus, accept_lens, new_lens: as for a chain (greedy_accept.commit_outputs)

In torch that is tree_acceptance.verify_tree_greedy + tree_acceptance.commit_path + greedy_accept.commit_outputs, ~50
small launches (gathers, the ancestor reduction, the path scatter, the rank scatter and argsort, the slot gather
and scatter, the outputs' arithmetic) on the host path of every tree step; on a small target the step is
host-bound and each launch costs wall time (issue #38; the chain step's own bookkeeping is one launch,
greedy_accept.py). ``tree_accept`` does it in one: a program per request, its N <= 32 nodes in one block of lanes,
the path found with [BLOCK, BLOCK] comparisons against the tree's ancestor mask. ``tree_accept_torch`` is those
three functions in order: the CPU path and the kernel's reference (``tests/test_tree_accept.py``, Triton's
interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..draft_tree import DraftTree
from ..tree_acceptance import commit_path, verify_tree_greedy
from .greedy_accept import accept_outputs, commit_outputs


@triton.jit
def _tree_accept_kernel(target_ptr, tokens_ptr, parents_ptr, depth_ptr, anc_ptr, prefix_ptr, pool_rows_ptr,
                        req_to_token_ptr, r2t_stride, out_tokens_ptr, next_ptr, bonus_ptr, commit_ptr, accept32_ptr,
                        new_lens_ptr, N, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    base = r.to(tl.int64) * N
    node = tl.arange(0, BLOCK)
    in_n = node < N
    rows, cols = node[:, None], node[None, :]
    tok = tl.load(tokens_ptr + base + node, mask=in_n, other=-1)
    dep = tl.load(depth_ptr + base + node, mask=in_n, other=0)
    par = tl.maximum(tl.load(parents_ptr + base + node, mask=in_n, other=0), 0)
    # a DEAD node's token -1 equals no target id; the root is the committed bonus
    fails = in_n & (node > 0) & (tok != tl.load(target_ptr + base + par, mask=in_n, other=0))
    # anc[i, j]: j is an ancestor of i or i itself (DraftTree.ancestors); i is accepted iff no such j fails
    anc = tl.load(anc_ptr + base * N + rows * N + cols, mask=(rows < N) & (cols < N), other=0) != 0
    accepted = in_n & (tl.sum((anc & fails[None, :]).to(tl.int32), axis=1) == 0)
    # siblings hold distinct tokens, so the accepted nodes are one path; the first index on a tie, as torch's argmax
    deepest = tl.max(tl.where(accepted, dep, -1), axis=0)
    last = tl.min(tl.where(accepted & (dep == deepest), node, BLOCK), axis=0)
    commit = deepest + 1
    on_path = tl.sum((anc & (rows == last)).to(tl.int32), axis=0) > 0  # row `last` of anc
    # path[k] = the path node at depth k; the token committed at k is the target's at it (node k + 1's token, which
    # matched it, for k < commit - 1; the bonus for k = commit - 1)
    path = tl.max(tl.where(on_path[None, :] & (dep[None, :] == rows), cols, -1), axis=1)
    kept = node < commit
    out = tl.where(kept, tl.load(target_ptr + base + tl.maximum(path, 0), mask=in_n & kept, other=0), -1)
    tl.store(out_tokens_ptr + base + node, out, mask=in_n)
    tl.store(next_ptr + base + node, tl.maximum(out, 0), mask=in_n)
    tl.store(bonus_ptr + r, tl.load(target_ptr + base + last))
    tl.store(commit_ptr + r, commit.to(tl.int64))
    tl.store(accept32_ptr + r, commit.to(tl.int32))
    p = tl.load(prefix_ptr + r)
    tl.store(new_lens_ptr + r, p + commit.to(p.dtype))
    # commit: node i's slot moves to column prefix + its rank, the path first (rank = depth), then the other
    # nodes in node order; all N slots are read before any is written (the barrier: no thread may overwrite a slot
    # that another has not read yet)
    off_path = in_n & ~on_path
    before = tl.sum((off_path[None, :] & (cols < rows)).to(tl.int32), axis=1)
    rank = tl.where(on_path, dep, commit + before)
    row = tl.load(pool_rows_ptr + r).to(tl.int64) * r2t_stride + p.to(tl.int64)
    slots = tl.load(req_to_token_ptr + row + node, mask=in_n)
    tl.debug_barrier()
    tl.store(req_to_token_ptr + row + rank, slots, mask=in_n)


def tree_accept(target_ids: torch.Tensor, tree: DraftTree, prefix: torch.Tensor, req_pool_indices: torch.Tensor,
                req_to_token: torch.Tensor):
    """(commit_lens, tokens, next_ids, bonus, accept_lens, new_lens) of a greedy tree verify, and its commit
    (req_to_token permuted in place), in one launch (CUDA). The same outputs as ``tree_accept_torch``.

    target_ids [bs, N] int64 contiguous (the target's argmax per node); ``tree``'s tokens / parents / depth [bs, N]
    int64 and ancestors [bs, N, N] bool, contiguous (N <= 32: a program's [BLOCK, BLOCK] tiles); prefix [bs] (the
    committed lengths, any integer dtype; new_lens keeps it); req_pool_indices [bs] (distinct rows);
    req_to_token [rows, max_len] with unit column stride."""
    bs, n = target_ids.shape
    parts = (target_ids, tree.tokens, tree.parents, tree.depth)
    if n > 32 or any(t.shape != (bs, n) or t.dtype != torch.int64 or not t.is_contiguous() for t in parts) \
            or tree.ancestors.shape != (bs, n, n) or not tree.ancestors.is_contiguous() or req_to_token.stride(1) != 1:
        raise ValueError(f"tree_accept: target_ids and the tree's tokens / parents / depth [bs, N <= 32] contiguous "
                         f"int64 and ancestors [bs, N, N] expected, got target_ids {tuple(target_ids.shape)}, tokens "
                         f"{tuple(tree.tokens.shape)}, ancestors {tuple(tree.ancestors.shape)}")
    commit, tokens, next_ids, bonus, accept32, new_lens = accept_outputs(bs, n, prefix)
    if bs:
        # the bool mask read as bytes (a view, no copy); one warp: a request's nodes fit in its lanes
        _tree_accept_kernel[(bs,)](target_ids, tree.tokens, tree.parents, tree.depth, tree.ancestors.view(torch.uint8),
                                   prefix, req_pool_indices, req_to_token, req_to_token.stride(0), tokens, next_ids,
                                   bonus, commit, accept32, new_lens, n, BLOCK=max(triton.next_power_of_2(n), 16),
                                   num_warps=1)
    return commit, tokens, next_ids, bonus, accept32, new_lens


def tree_accept_torch(target_ids: torch.Tensor, tree: DraftTree, prefix: torch.Tensor,
                      req_pool_indices: torch.Tensor, req_to_token: torch.Tensor):
    """``tree_accept`` in torch: the tree rule (``tree_acceptance.verify_tree_greedy`` on the argmax ids), the
    commit (``tree_step.commit_path``), then ``commit_outputs``."""
    commit_lens, tokens, path = verify_tree_greedy(tree, target_ids)
    commit_path(req_to_token, req_pool_indices, prefix, path)
    return (commit_lens, tokens) + commit_outputs(commit_lens, tokens, prefix)
