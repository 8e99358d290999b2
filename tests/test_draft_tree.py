"""Draft trees (sglang_dflash/draft_tree.py): the best-first tree is exactly the N-1 most probable paths under the
draft's per-position distributions, in topological order, with the right attention mask."""

import itertools

import pytest
import torch

from sglang_dflash.draft_tree import DEAD, ancestor_mask, build_draft_tree, chain_tree


def brute_force_paths(log_probs: torch.Tensor, count: int) -> list[float]:
    """The `count` highest path scores over every path of depth 1..D (log_probs [D, V]), by enumeration."""
    d, v = log_probs.shape
    scores = []
    for depth in range(1, d + 1):
        for path in itertools.product(range(v), repeat=depth):
            scores.append(sum(log_probs[j, t].item() for j, t in enumerate(path)))
    return sorted(scores, reverse=True)[:count]


@pytest.mark.parametrize("size", [2, 5, 16, 40])
def test_tree_is_the_most_probable_paths(size):
    g = torch.Generator().manual_seed(size)
    n, depth_limit, v = 6, 3, 5
    logits = torch.randn(n, depth_limit, v, generator=g) * 2
    anchor = torch.randint(v, (n,), generator=g)
    tree = build_draft_tree(anchor, logits, size)
    lp = torch.log_softmax(logits, -1)
    assert tree.tokens.shape == (n, size) and (tree.tokens[:, 0] == anchor).all()
    for r in range(n):
        nodes = {}  # node -> its token path from the root
        for i in range(1, size):
            p = tree.parents[r, i].item()
            assert 0 <= p < i and tree.depth[r, i] == tree.depth[r, p] + 1 <= depth_limit
            nodes[i] = nodes.get(p, ()) + (tree.tokens[r, i].item(),)
            score = sum(lp[r, j, t].item() for j, t in enumerate(nodes[i]))
            assert tree.log_prob[r, i].item() == pytest.approx(score, abs=1e-5)
        assert len(set(nodes.values())) == size - 1  # no path twice
        expected = brute_force_paths(lp[r], size - 1)
        got = sorted(tree.log_prob[r, 1:].tolist(), reverse=True)
        assert got == pytest.approx(expected, abs=1e-5)
        # best-first: nodes come out in non-increasing path probability
        assert (tree.log_prob[r, 1:].diff() <= 1e-6).all()


def test_ancestor_mask_is_the_parent_walk():
    g = torch.Generator().manual_seed(3)
    tree = build_draft_tree(torch.zeros(4, dtype=torch.long), torch.randn(4, 5, 7, generator=g), 24)
    for r in range(4):
        for i in range(24):
            walk, j = set(), i
            while j >= 0:
                walk.add(j)
                j = tree.parents[r, j].item()
            assert set(tree.ancestors[r, i].nonzero()[:, 0].tolist()) == walk
    assert torch.equal(ancestor_mask(tree.parents), tree.ancestors)


def test_peaked_drafts_keep_the_chain_and_chain_tree_is_a_chain():
    """When each position's argmax dominates, the best-first tree of B nodes IS the chain of argmaxes."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 50, generator=g)
    top = logits.argmax(-1)
    logits.scatter_(2, top[:, :, None], 20.0)
    anchor = torch.tensor([4, 5, 6])
    tree = build_draft_tree(anchor, logits, 8)
    chain = chain_tree(anchor, top)
    for field in ("tokens", "parents", "depth", "ancestors"):
        assert torch.equal(getattr(tree, field), getattr(chain, field)), field
    assert torch.equal(chain.ancestors[0], torch.ones(8, 8, dtype=torch.bool).tril())


def test_small_vocabulary_leaves_dead_nodes():
    """Fewer possible paths than nodes (V = 2, depth 2: 6 paths, 7 node slots): the spare node is DEAD."""
    tree = build_draft_tree(torch.tensor([0]), torch.randn(1, 2, 2), 8)
    assert (tree.tokens[0, 1:] == DEAD).sum() == 1 and tree.tokens[0, -1] == DEAD
    assert torch.isinf(tree.log_prob[0, -1])


@pytest.mark.parametrize("size,vocab", [(16, 50), (8, 5), (32, 3)])
def test_build_draft_tree_is_graph_capturable(size, vocab):
    """The serving worker records build_draft_tree into the draft CUDA graph (serving/tree_graphs.py): no host
    syncs, no data-dependent shapes, no host-to-device copies of Python values (tests/_capturable.py)."""
    from _capturable import assert_capturable

    g = torch.Generator().manual_seed(size)
    logits = torch.randn(3, 15, vocab, generator=g)
    logits[0, :, 1:] = -torch.inf  # one live path of 15 nodes: a tree of 32 has DEAD nodes, built by the same ops
    tree = assert_capturable(build_draft_tree, torch.tensor([1, 2, 0]), logits, size)
    assert (tree.tokens[0, 1:16] == 0).all() and (tree.tokens[0, 16:] == DEAD).all()
