"""Tree verification (sglang_dflash/tree_acceptance.py): greedy keeps the target's own path, a chain tree gives the
chain rules' commits, and the sampled rule emits exactly the target's distribution (an exact law over the emitted
sequences, chi-square powered; the bugs planted in test_mutations_algorithm.py must fail it)."""

import pytest
import torch

from _stats import chi2_pvalue, detectable_tv, grouped_chi2

from sglang_dflash.acceptance import verify_greedy, verify_sampled
from sglang_dflash.draft_tree import DraftTree, ancestor_mask, build_draft_tree, chain_tree
from sglang_dflash.tree_acceptance import verify_tree_greedy, verify_tree_sampled


def walk_greedy(tokens, parents, target_ids):
    """The greedy rule by hand for one request: follow the child equal to the target's argmax."""
    u, out = 0, []
    while True:
        nxt = [c for c in range(len(tokens)) if parents[c] == u and tokens[c] == target_ids[u]]
        if not nxt:
            return out + [target_ids[u]]
        u = nxt[0]
        out.append(tokens[u])


def random_trees(n, size, depth, v, seed):
    g = torch.Generator().manual_seed(seed)
    return build_draft_tree(torch.randint(v, (n,), generator=g), torch.randn(n, depth, v, generator=g) * 2, size), g


@pytest.mark.parametrize("size", [4, 16, 33])
def test_greedy_walks_the_targets_path(size):
    n, v = 64, 5
    tree, g = random_trees(n, size, 6, v, size)
    # the target agrees with the tree's best child often: accepts of every depth occur
    target_ids = torch.where(torch.rand(n, size, generator=g) < 0.8, torch.zeros(n, size, dtype=torch.long),
                             torch.randint(v, (n, size), generator=g))
    for r in range(n):  # make the "agreeing" target pick the first child's token where a node has one
        for i in range(size):
            kids = (tree.parents[r] == i).nonzero()[:, 0]
            if len(kids) and target_ids[r, i] == 0:
                target_ids[r, i] = tree.tokens[r, kids[0]]
    commit, tokens, path = verify_tree_greedy(tree, torch.nn.functional.one_hot(target_ids, v).float())
    for r in range(n):
        want = walk_greedy(tree.tokens[r].tolist(), tree.parents[r].tolist(), target_ids[r].tolist())
        assert tokens[r, :commit[r]].tolist() == want and (tokens[r, commit[r]:] == -1).all()
        kept = path[r, :commit[r]]
        assert kept[0] == 0 and (tree.depth[r, kept] == torch.arange(commit[r])).all()
        assert (tree.tokens[r, kept[1:]] == tokens[r, :commit[r] - 1]).all() and (path[r, commit[r]:] == -1).all()
    if size > 4:
        assert len(set(commit.tolist())) > 3


def test_chain_tree_gives_the_chain_rules():
    """A chain tree is the plain DFlash block: greedy commits equal verify_greedy's, and the sampled rule consumes
    uniforms in the same order as verify_sampled, so with one seed both commit the same tokens."""
    g = torch.Generator().manual_seed(0)
    n, b, v = 256, 6, 9
    logits = torch.randn(n, b, v, generator=g) * 3
    drafts = torch.where(torch.rand(n, b - 1, generator=g) < 0.8, logits[:, :-1].argmax(-1),
                         torch.randint(v, (n, b - 1), generator=g))
    tree = chain_tree(torch.zeros(n, dtype=torch.long), drafts)
    c1, t1 = verify_greedy(drafts, logits)
    c2, t2, _ = verify_tree_greedy(tree, logits)
    assert torch.equal(c1, c2) and torch.equal(t1, t2[:, :b])
    probs = torch.softmax(logits, -1)
    c1, t1 = verify_sampled(drafts, probs, torch.Generator().manual_seed(4))
    c2, t2, _ = verify_tree_sampled(tree, probs, torch.Generator().manual_seed(4))
    assert torch.equal(c1, c2) and torch.equal(t1, t2[:, :b]) and len(set(c1.tolist())) > 3


def test_tree_containing_the_chain_commits_at_least_the_chain():
    """Greedy on a tree that contains the chain of argmaxes commits the chain's tokens and possibly more, all of them
    the target's greedy tokens (the target here: a fixed next-token table on the last token)."""
    g = torch.Generator().manual_seed(2)
    n, b, v = 128, 6, 7
    table = torch.randint(v, (v,), generator=g)  # the target's greedy next token after token x
    anchor = torch.randint(v, (n,), generator=g)
    greedy = [anchor]
    for _ in range(24):
        greedy.append(table[greedy[-1]])
    greedy = torch.stack(greedy[1:], 1)
    # a drafter that often ranks the target's token first, or second (where only a tree can still accept it)
    logits = torch.randn(n, b - 1, v, generator=g)
    boost = torch.where(torch.rand(n, b - 1, generator=g) < 0.6, 3.0, 1.2)
    logits.scatter_add_(2, greedy[:, :b - 1, None], boost[:, :, None])
    tree = build_draft_tree(anchor, logits, 24)
    chain = chain_tree(anchor, logits.argmax(-1))
    tree_ids, chain_ids = table[tree.tokens.clamp(min=0)], table[chain.tokens]
    c_tree, t_tree, _ = verify_tree_greedy(tree, tree_ids)
    c_chain, t_chain = verify_greedy(chain.tokens[:, 1:], torch.nn.functional.one_hot(chain_ids, v).float())
    contained = longer = 0
    for r in range(n):
        assert t_tree[r, :c_tree[r]].tolist() == greedy[r, :c_tree[r]].tolist()  # lossless
        chain_in_tree = any(tree.tokens[r, tree.ancestors[r, i]].tolist() == chain.tokens[r].tolist()
                            for i in range(24))
        if chain_in_tree:
            assert c_tree[r] >= c_chain[r]
            assert t_tree[r, :c_chain[r]].tolist() == t_chain[r, :c_chain[r]].tolist()
            contained += 1
            longer += int(c_tree[r] > c_chain[r])
    assert contained > 10 and longer > 5, (contained, longer)  # both cases ran


def test_point_mass_rows_reduce_to_greedy():
    n, size, v = 128, 20, 6
    tree, g = random_trees(n, size, 5, v, 7)
    logits = torch.randn(n, size, v, generator=g) * 3
    kids = tree.tokens.gather(1, (tree.parents == 0).long().argmax(1, keepdim=True))  # steer toward the tree
    logits[:, 0].scatter_(1, kids, 10.0)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), v).float()
    a = verify_tree_greedy(tree, logits)
    b = verify_tree_sampled(tree, onehot, g)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(set(a[0].tolist())) > 1


# ---------------------------------------------------------------- the sampled rule's law, exactly
# Two tree kinds over V = 6 tokens (rows of the batch alternate). Kind 0, written out: the root has three children
# (tokens 0, 1, 4), node 1 two (1, 2), node 2 one child of target probability 0 (token 2: never accepted), node 4 one
# (3); every row of p keeps mass outside its children (the residual path) and a token of probability 0. Kind 1: a
# best-first tree from fixed random draft logits with random target rows.
HAND_TREE = dict(tokens=[5, 0, 1, 4, 1, 2, 2, 3], parents=[-1, 0, 0, 0, 1, 1, 2, 4])
HAND_PROBS = torch.tensor([
    [0.35, 0.25, 0.10, 0.10, 0.15, 0.05],
    [0.10, 0.40, 0.30, 0.05, 0.15, 0.00],
    [0.20, 0.20, 0.00, 0.30, 0.30, 0.00],
    [0.30, 0.30, 0.10, 0.10, 0.20, 0.00],
    [0.10, 0.10, 0.10, 0.50, 0.20, 0.00],
    [0.00, 0.25, 0.25, 0.25, 0.25, 0.00],
    [0.50, 0.10, 0.10, 0.10, 0.20, 0.00],
    [0.20, 0.20, 0.20, 0.20, 0.20, 0.00],
])
ALPHA = 1e-4


def hand_tree() -> DraftTree:
    parents = torch.tensor([HAND_TREE["parents"]])
    depth = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 3]])
    return DraftTree(torch.tensor([HAND_TREE["tokens"]]), parents, depth, ancestor_mask(parents), torch.zeros(1, 8))


def sequence_law(tokens: list[int], parents: list[int], probs: torch.Tensor) -> dict[tuple, float]:
    """The exact law of the committed tokens under target-only sampling from the node rows: sample x ~ p_u; if x is
    a child of u the walk goes on there, else it ends with x (a leaf's draw always ends it)."""
    law = {}

    def walk(u, prefix, mass):
        children = {tokens[c]: c for c in range(len(tokens)) if parents[c] == u}
        for x, px in enumerate(probs[u].tolist()):
            if px > 0:
                if x in children:
                    walk(children[x], prefix + (x,), mass * px)
                else:
                    law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + mass * px
    walk(0, (), 1.0)
    return law


def tree_law_failures(n: int = 80_000, seed: int = 11):
    """Returns (p-value, draws, df, distinct committed lengths) of one grouped chi-square over both kinds' exact laws
    of the committed sequences."""
    g = torch.Generator().manual_seed(seed)
    built = build_draft_tree(torch.tensor([5]), torch.randn(1, 3, 6, generator=g) * 1.5, 10)
    built_probs = torch.softmax(torch.randn(10, 6, generator=g) * 1.2, -1)
    built_probs[:, 5] = 0  # a token of probability 0 in every row
    built_probs /= built_probs.sum(-1, keepdim=True)
    kinds = [(hand_tree(), HAND_PROBS), (built, built_probs)]
    groups, lengths = [], set()
    for k, (tree, probs) in enumerate(kinds):
        m = n // 2
        batch = DraftTree(*(getattr(tree, f).expand(m, *getattr(tree, f).shape[1:]).contiguous()
                            for f in ("tokens", "parents", "depth", "ancestors", "log_prob")))
        commit, tokens, path = verify_tree_sampled(batch, probs.expand(m, *probs.shape).contiguous(), g)
        law = sequence_law(tree.tokens[0].tolist(), tree.parents[0].tolist(), probs)
        cells = {s: i for i, s in enumerate(law)}
        counts = torch.zeros(len(cells) + 1)  # last cell: a sequence the target never emits
        for c, row in zip(commit.tolist(), tokens.tolist()):
            counts[cells.get(tuple(row[:c]), len(cells))] += 1
            lengths.add(c)
        groups.append((counts, torch.tensor(list(law.values()) + [0.0])))
    pvalue, draws, df, impossible = grouped_chi2(groups)
    return pvalue, draws, df, impossible, lengths


def test_tree_sampled_emits_target_distribution():
    """80,000 tree verifications, half on each kind: the committed sequences follow the exact law of target-only
    sampling (sequence_law), and sequences the target never emits (e.g. a child's token ending the walk) never
    appear. Power: one grouped chi-square, ALPHA = 1e-4, >= 95% power against any error of mean TV >= 0.02 over the
    committed sequences (_stats.detectable_tv, enforced below). The planted bugs of test_mutations_algorithm.py move
    far more: accepting a later sibling with p(x) instead of p'(x) emits the hand tree's root children 1 and 4 with
    0.16 and 0.07 instead of 0.25 and 0.15 (TV 0.16 on the first token alone), and drawing from a residual that
    keeps a rejected sibling emits sequences of probability 0."""
    pvalue, draws, df, impossible, lengths = tree_law_failures()
    assert not impossible, "a committed sequence the target never emits (probability 0 under its law)"
    assert pvalue > ALPHA, f"committed sequences do not follow the target's law: p-value {pvalue:.3g} ({draws} draws)"
    assert detectable_tv(draws, df, ALPHA) < 0.02, (draws, df)
    assert {1, 2, 3, 4} <= lengths  # every depth of the hand tree, leaf bonus included
