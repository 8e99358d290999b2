"""A greedy tree verify's fused accept + commit (``sglang_dflash.kernels.tree_accept``) == its torch twin.

The Triton kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (tests/_interpreter.py); on CUDA natively too. It
must equal ``tree_accept_torch`` on every output (values and dtypes) and leave the whole req_to_token as the twin's
commit does (the accepted path's slots first, the rest in node order; other rows and columns untouched), over
best-first trees of N = 4..32 nodes from blocks of 2..32 positions, rows with DEAD nodes, targets that accept every
depth from the root alone to the deepest leaf, int32 / int64 committed lengths, a batch of one, and request-pool rows
in scrambled order. The twin is the three calls the tree step made before (verify_tree_greedy, commit_path,
commit_outputs), and the comparison is fine enough to see a path committed in the wrong order.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _interpreter import assert_all_equal, needs_gpu, print_interpreted, run_interpreted

from sglang_dflash.draft_tree import DEAD, DraftTree, build_draft_tree
from sglang_dflash.kernels.greedy_accept import commit_outputs
from sglang_dflash.kernels.tree_accept import tree_accept_torch
from sglang_dflash.tree_acceptance import commit_path, verify_tree_greedy

NAMES = ("commit_lens", "tokens", "next_ids", "bonus", "accept_lens", "new_lens")
V = 11

# (bs, N, B, prefix dtype, req_to_token dtype): B - 1 draft positions, so depths up to B - 1
CASES = [(1, 16, 16, torch.int64, torch.int32), (6, 4, 2, torch.int32, torch.int32),
         (9, 8, 32, torch.int64, torch.int32), (7, 16, 5, torch.int32, torch.int64),
         (12, 32, 16, torch.int64, torch.int32), (5, 32, 32, torch.int32, torch.int32),
         (8, 32, 4, torch.int64, torch.int32)]


def make_case(bs: int, N: int, B: int, prefix_dt: torch.dtype, r2t_dt: torch.dtype, seed: int, device: str = "cpu"):
    """(target_ids, tree, prefix, req_pool_indices, req_to_token, planted commit lengths). Rows 1, 4, 7, ..: the
    drafter ranks one or two tokens only (its other logits -inf), so a row with fewer paths than nodes holds DEAD
    nodes. Row r plants an accepted path to a live node of depth: the row's deepest (r % 4 = 0, 1), 0 (the root
    alone, r % 4 = 2), a random one (r % 4 = 3). The target's argmax at each path node is the next path node's
    token, at the end a token no child holds; elsewhere random ids (off the path, where nothing is accepted)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, B - 1, V, generator=g) * 2
    for r in range(1, bs, 3):
        logits[r, :, 1 + (r // 3) % 2:] = -torch.inf
    tree = build_draft_tree(torch.randint(0, V, (bs,), generator=g), logits, N)
    target = torch.randint(0, V, (bs, N), generator=g)
    planted = []
    for r in range(bs):
        live = (tree.tokens[r] != DEAD).nonzero()[:, 0]
        depths = tree.depth[r, live]
        deepest = int(depths.max())
        want = (deepest, deepest, 0)[r % 4] if r % 4 < 3 else int(torch.randint(0, deepest + 1, (), generator=g))
        at = (depths == want).nonzero()[:, 0]
        end = int(live[at[int(torch.randint(0, len(at), (), generator=g))]])
        target[r, end] = V + r  # outside the vocabulary: no child of `end` matches it
        node = end
        while node > 0:
            parent = int(tree.parents[r, node])
            target[r, parent] = tree.tokens[r, node]
            node = parent
        planted.append(want + 1)
    rows = bs + 4
    max_len = 3 * N + 8
    prefix = torch.randint(0, max_len - N + 1, (bs,), generator=g).to(prefix_dt)
    prefix[0] = max_len - N  # the last N columns of a row
    pool = torch.randperm(rows, generator=g)[:bs]
    req_to_token = torch.randperm(rows * max_len, generator=g).to(r2t_dt).view(rows, max_len)
    tree = DraftTree(*(getattr(tree, f).to(device) for f in ("tokens", "parents", "depth", "ancestors", "log_prob")))
    return (target.to(device), tree, prefix.to(device), pool.to(device), req_to_token.to(device),
            torch.tensor(planted))


def _same(got, want) -> bool:
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))


def _kernel_vs_twin(device: str) -> dict[str, bool]:
    from sglang_dflash.kernels.tree_accept import tree_accept

    out = {}
    for i, (bs, N, B, pdt, rdt) in enumerate(CASES):
        target, tree, prefix, pool, r2t, _ = make_case(bs, N, B, pdt, rdt, seed=i, device=device)
        r2t_kernel = r2t.clone()
        got = tree_accept(target, tree, prefix, pool, r2t_kernel)
        want = tree_accept_torch(target, tree, prefix, pool, r2t)
        out[f"{bs}x{N}/B{B}/{pdt}/{rdt}"] = _same(got, want) and torch.equal(r2t_kernel, r2t)
    return out


def test_cases_cover_dead_nodes_and_every_accepted_depth():
    dead_rows, seen = 0, set()
    for i, (bs, N, B, pdt, rdt) in enumerate(CASES):
        target, tree, prefix, pool, r2t, planted = make_case(bs, N, B, pdt, rdt, seed=i)
        got = dict(zip(NAMES, tree_accept_torch(target, tree, prefix, pool, r2t)))
        assert torch.equal(got["commit_lens"], planted), "the planted paths are what greedy accepts"
        dead_rows += int((tree.tokens == DEAD).any(dim=1).sum())
        full = tree.depth.masked_fill(tree.tokens == DEAD, 0).max(dim=1).values + 1
        seen.update((N, "root only") for c in planted.tolist() if c == 1)
        seen.update((N, "full depth") for c, f in zip(planted.tolist(), full.tolist()) if c == f > 1)
        seen.update((N, "between") for c, f in zip(planted.tolist(), full.tolist()) if 1 < c < f)
    assert dead_rows >= 5
    sizes = {c[1] for c in CASES}
    assert {(N, "full depth") for N in sizes} <= seen and {(N, "root only") for N in sizes} <= seen
    assert {N for N, kind in seen if kind == "between"} == sizes - {4}  # N = 4, B = 2: depth 1 has no between


def test_torch_twin_is_the_three_calls_of_the_old_tree_step():
    """verify_tree_greedy on the target's logits, commit_path, commit_outputs: what _tree_decode_step ran before."""
    for i, (bs, N, B, pdt, rdt) in enumerate(CASES):
        target, tree, prefix, pool, r2t, _ = make_case(bs, N, B, pdt, rdt, seed=i)
        logits = torch.nn.functional.one_hot(target, V + bs).float()  # argmax = target
        old_r2t = r2t.clone()
        commit_lens, tokens, path = verify_tree_greedy(tree, logits)
        commit_path(old_r2t, pool, prefix, path)
        want = (commit_lens, tokens) + commit_outputs(commit_lens, tokens, prefix)
        got = tree_accept_torch(target, tree, prefix, pool, r2t)
        assert _same(got, want) and torch.equal(r2t, old_r2t)
        got = dict(zip(NAMES, got))
        assert got["accept_lens"].dtype == torch.int32 and got["new_lens"].dtype == pdt
        assert got["next_ids"].shape == (bs * N,) and torch.equal(got["bonus"], target[torch.arange(bs), path.gather(
            1, (commit_lens - 1)[:, None])[:, 0]])


def test_a_path_committed_in_the_wrong_order_differs():
    """The comparison's resolution: the twin's req_to_token with the path's order reversed (one planted bug a
    kernel could have) differs from the right commit wherever two or more nodes were kept."""
    bs, N, B, pdt, rdt = CASES[4]
    target, tree, prefix, pool, r2t, planted = make_case(bs, N, B, pdt, rdt, seed=4)
    right, wrong = r2t.clone(), r2t.clone()
    _, _, path = verify_tree_greedy(tree, target)
    commit_path(right, pool, prefix, path)
    flipped = path.clone()
    for r in range(bs):
        c = int(planted[r])
        flipped[r, :c] = path[r, :c].flip(0)
    commit_path(wrong, pool, prefix, flipped)
    for r in range(bs):
        assert torch.equal(right[pool[r]], wrong[pool[r]]) == (int(planted[r]) == 1), r
    assert (planted > 2).any()


def test_tree_accept_checks_its_inputs():
    from sglang_dflash.kernels.tree_accept import tree_accept

    target, tree, prefix, pool, r2t, _ = make_case(2, 8, 8, torch.int64, torch.int32, seed=0)
    with pytest.raises(ValueError, match="tree_accept"):
        tree_accept(target[:, :4], tree, prefix, pool, r2t)  # not the tree's size
    with pytest.raises(ValueError, match="tree_accept"):
        tree_accept(target.t().contiguous().t(), tree, prefix, pool, r2t)  # not contiguous
    big = make_case(1, 33, 8, torch.int64, torch.int32, seed=0)
    with pytest.raises(ValueError, match="N <= 32"):
        tree_accept(*big[:5])


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


def test_interpreted_kernel_equals_torch_twin(interpreted):
    assert len(interpreted) == len(CASES)
    assert_all_equal(interpreted)


@needs_gpu
def test_gpu_kernel_equals_torch_twin():
    assert_all_equal(_kernel_vs_twin("cuda"))



@needs_gpu
def test_gpu_no_compile_on_a_tree_step_after_the_start_up_warm_up():
    """kernel_warmup.warm_tree_accept (the worker's start-up, issue #48) compiles the variant a tree step then uses:
    the step's launch adds no kernel to the cache. N = 12 over rows of 44 columns is no other case's variant, so
    the warm-up itself must compile exactly one."""
    from sglang_dflash.kernels.tree_accept import _tree_accept_kernel, tree_accept
    from sglang_dflash.serving.kernel_warmup import warm_tree_accept

    def compiled() -> int:  # Triton 3.x: device_caches[device][0] is the kernel cache
        return sum(len(entry[0]) for entry in _tree_accept_kernel.device_caches.values())

    # SGLang's dtypes: seq_lens and req_pool_indices int64, req_to_token int32
    target, tree, prefix, pool, r2t, _ = make_case(5, 12, 16, torch.int64, torch.int32, seed=3, device="cuda")
    before = compiled()
    assert warm_tree_accept(12, r2t)
    assert compiled() == before + 1
    tree_accept(target, tree, prefix, pool, r2t)
    torch.cuda.synchronize()
    assert compiled() == before + 1, "the tree step compiled a new variant"

if __name__ == "__main__" and "--interpret" in sys.argv:
    print_interpreted(_kernel_vs_twin)
