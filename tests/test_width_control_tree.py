"""The width policy with the draft tree as one more shape (SGLANG_DFLASH_TREE, issue #38 item 4), driven on CPU
with a fake clock and synthetic acceptance, as tests/test_width_control.py drives the chain widths.

Why it matters: on an H100 a tree-16 step costs 1.18-1.25 full chain steps on a GPU-bound 8B target and ~1.6 on
the host-bound SmolLM2, and raises the commit per step by 23-30% (benchmarks/results/tree-graphs-h100). So a tree
pays on some targets and batch sizes and loses on others: the policy must price it from its own step time and its
own commit, and must keep the chain's per-position statistics free of tree rows."""

import json

import numpy as np
import pytest

from sglang_dflash import settings
from sglang_dflash.adaptive import TreeStats, best_shape, best_width
from sglang_dflash.serving import width_control
from sglang_dflash.serving.width_control import EXPLORE_STEPS, WidthController, WidthControls

BLOCK = 16
TREE = BLOCK  # the tree's key (adaptive.tree_key)
CHAIN_RATE = 0.8  # per-draft acceptance of the chain: E[commit | 15] = 4.86
TREE_RATE = 0.86  # the tree's rows: E[commit] = 6.50, 1.34x the full chain's
BS = 8  # a batch of 8 rows per step: one step's commits are evidence enough to be stable


def _plain(bs: int) -> float:
    return 0.0067 + 0.000025 * bs


def _chain_cost(bs: int, k: int) -> float:
    """A host-bound-like chain: every drafted width costs 1.5 plain steps, so the full chain is the best chain."""
    return _plain(bs) * (1.0 if k == 0 else 1.5)


def _cost_with_tree(tree_factor: float):
    """Step seconds where a tree step costs tree_factor full chain steps."""
    return lambda bs, k: _chain_cost(bs, BLOCK - 1) * tree_factor if k == TREE else _chain_cost(bs, k)


def _expected(rate: float, cap: int) -> float:
    return float(sum(rate ** i for i in range(cap + 1)))


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _controller(env=None) -> WidthController:
    controls = WidthControls.from_env(BLOCK, env={settings.TREE: "16", **(env or {})})
    ctl = WidthController(controls, BLOCK)
    ctl._clock = FakeClock()
    assert ctl.tree == TREE and ctl.shapes[-1] == TREE
    return ctl


def _run(ctl, bs: int, steps: int, rng, cost, chain_rate=CHAIN_RATE, tree_rate=TREE_RATE,
         tree_ok: bool = True) -> list[int]:
    """steps decode steps at batch size bs (the batch may take a tree iff tree_ok); chain drafts accepted with
    probability chain_rate each, tree rows reach depth by tree_rate (a tree of 16 commits up to 16 tokens)."""
    ks = []
    for _ in range(steps):
        k = ctl.choose(bs, tree_ok=tree_ok)
        ks.append(k)
        ctl.step_begin(bs, k)
        rate, cap = (tree_rate, BLOCK - 1) if k == TREE else (chain_rate, k)
        accepted = np.minimum(rng.geometric(1.0 - rate, size=bs) - 1 if rate > 0 else np.zeros(bs, int), cap)
        ctl.on_verify_complete(accepted.tolist(), bs)
        ctl._clock.t += cost(bs, k)
    return ks


def test_best_shape_is_best_width_plus_the_tree():
    expected = np.array([1.0] + [1.0 + 0.1 * k for k in range(1, 16)])
    costs = {0: 1.0, 3: 1.2, 15: 1.5}
    k = best_width(expected, costs)
    assert best_shape(expected, costs) == k == best_shape(expected, {**costs, TREE: 1.0}, None)
    rate = expected[k] / costs[k]
    assert best_shape(expected, {**costs, TREE: 2.0}, tree_commit=2.0 * rate * 1.05) == TREE
    assert best_shape(expected, {**costs, TREE: 2.0}, tree_commit=2.0 * rate * 1.01) == k  # within MIN_GAIN
    # a tree is never priced below a plain step (a mispriced tree must not beat k = 0 by noise)
    assert best_shape(np.ones(16), {0: 1.0, TREE: 0.5}, tree_commit=1.01) == 0


def test_tree_stats_decayed_mean_prior_and_staleness():
    t = TreeStats()
    assert t.expected_commit(prior=3.0) == 3.0 and t.evidence_commit(prior=3.0) == 3.0
    t.update([5, 5, 5, 5])
    assert t.evidence_commit(prior=1.0) == pytest.approx(5.0)
    assert 4.0 < t.expected_commit(prior=1.0) < 5.0  # one prior row against four
    for _ in range(2000):
        t.update([5] * 8)
    for _ in range(2000):  # a long chain phase: the estimate stays, its weight falls to the floor
        t.skip()
    assert t.evidence_commit(prior=1.0) == pytest.approx(5.0) and t._rows == pytest.approx(8.0)
    t.update([1] * 8)  # so one probe of 8 rows moves it halfway
    assert t.evidence_commit(prior=1.0) == pytest.approx(3.0, abs=0.1)


def test_a_tree_that_pays_is_chosen_after_exploration():
    """(a) tree step 1.2x the full chain's, commit 1.34x: the tree wins (rate +12%) and runs most steps."""
    rng = np.random.default_rng(0)
    ctl = _controller()
    ks = _run(ctl, BS, 600, rng, _cost_with_tree(1.2))
    assert ctl._explored[BS, TREE] >= EXPLORE_STEPS  # explored like a width
    assert ctl.policy.decision(BS, tree_ok=True) == TREE
    late = ks[200:]
    assert late.count(TREE) > 0.85 * len(late), {k: late.count(k) for k in set(late)}
    assert 15 in late  # the chain's full width is probed (its statistics do not get the tree's rows)
    # the tree's commit went to its own estimate, the chain's positions to theirs
    assert ctl.policy.tree_expected() == pytest.approx(_expected(TREE_RATE, 15), rel=0.1)
    chain = ctl.policy.stats.expected_commit()[15]  # few chain rows (probes): noisy, but no tree rows
    assert 2.5 < chain < 0.9 * _expected(TREE_RATE, 15), chain
    assert "tree:" in ctl.policy.summary() and "tree:" in ctl.cost_summary(BS)


def test_a_tree_that_costs_more_than_it_gains_is_only_probed():
    """(b) tree step 1.6x the full chain's, the same commit gain: the full chain runs, the tree is probed now and
    then. The probes' budget is 0.5% of the time; a tree probe's rows are noisy (a row commits 1..16 tokens), so
    now and then a few probes in a row push the estimate over the chain's and a short burst of tree steps runs
    until their rows pull it back: all of it together costs about 1% of the best rate here."""
    rng = np.random.default_rng(1)
    ctl = _controller()
    cost = _cost_with_tree(1.6)
    ks = _run(ctl, BS, 3000, rng, cost)
    assert ctl.policy.decision(BS, tree_ok=True) == 15
    late = ks[300:]
    assert 0 < late.count(TREE) < 0.05 * len(late) and ctl.policy.tree_probes > 10
    # the rate lost to trees: tokens per second of the run against the full chain's, at the true expectations
    tokens = sum(_expected(TREE_RATE, 15) if k == TREE else _expected(CHAIN_RATE, k) for k in late)
    rate = tokens / sum(cost(BS, k) for k in late)
    assert rate > 0.985 * _expected(CHAIN_RATE, 15) / cost(BS, 15)


def test_a_tree_that_pays_is_timed_at_each_new_bucket_and_its_floor_is_its_own():
    """Issue #45's pruning (`_cannot_win`) with trees: a tree step may cost less than a long chain (a small tree), so
    its step-time floor is its own points and k = 0's only; a tree that pays is still timed at every new bucket
    (the batch grows 1 -> 8: its batch-1 time does not tell its batch-8 time)."""
    rng = np.random.default_rng(3)
    ctl = _controller()
    cost = _cost_with_tree(1.2)
    for bs in (1, 2, 4, 8):
        _run(ctl, bs, 60, rng, cost)
    assert all(ctl._explored[b, TREE] >= EXPLORE_STEPS for b in (1, 2, 4, 8))
    assert ctl.policy.decision(8, tree_ok=True) == TREE
    costs = ctl.policy.costs
    own_or_plain = max(s for k in (0, TREE) for b, s in costs.points(k) if b <= 8)
    assert ctl._time_floor(8, TREE) == own_or_plain
    costs.set(8, 7, 1.0)  # a chain width's entry (absurd here) bounds nothing about a tree step
    assert ctl._time_floor(8, TREE) == own_or_plain


def test_a_useless_drafter_plain_steps_and_no_tree_explored():
    """(c) nothing accepted, chain or tree: k = 0 runs, and once the evidence says no drafted shape can pay the tree
    is neither explored (at any bucket) nor probed."""
    rng = np.random.default_rng(2)
    ctl = _controller()
    ks = []
    for bs in (1, 8, 32):
        ks += _run(ctl, bs, 300, rng, _cost_with_tree(1.2), chain_rate=0.0, tree_rate=0.0)
    assert TREE not in ks and ctl.policy.tree_probes == 0
    assert all(ctl._explored[b, TREE] == 0 for b in (1, 8, 32))
    assert ks[100:].count(0) > 0.9 * len(ks[100:])


def test_a_batch_that_does_not_qualify_never_runs_a_tree_nor_touches_its_statistics():
    """(d) tree_ok False (sampled requests, penalties, ...): chain steps only, and the tree's estimate, row count
    and step-time entries stay what the qualifying steps left."""
    rng = np.random.default_rng(3)
    ctl = _controller()
    _run(ctl, 1, 300, rng, _cost_with_tree(1.2))
    ks = _run(ctl, 1, 1, rng, _cost_with_tree(1.2), tree_ok=False)  # closes the last tree step (its cycle ends here)
    tree = ctl.policy.tree_stats
    before = (tree.evidence_commit(1.0), tree.rows_seen, ctl.policy.costs.cost(1, TREE))
    ks += _run(ctl, 1, 500, rng, _cost_with_tree(1.2), tree_ok=False)
    ks += _run(ctl, 8, 100, rng, _cost_with_tree(1.2), tree_ok=False)
    assert TREE not in ks and ctl._explored[8, TREE] == 0
    # the estimate, the rows and the price stay (only the evidence's weight ages, as after any chain step)
    assert (tree.evidence_commit(1.0), tree.rows_seen, ctl.policy.costs.cost(1, TREE)) == pytest.approx(before)


def test_tree_rows_do_not_enter_the_chain_statistics():
    ctl = _controller()
    stats = ctl.policy.stats
    for _ in range(20):
        stats.update(np.full(8, 3), 15)  # d_1, d_2 accepted, d_3 rejected
    a = stats.evidence_commit().copy()
    for _ in range(50):
        ctl.policy.record(8, TREE, np.full(8, 16), None)  # trees commit everything
    assert np.allclose(stats.evidence_commit(), a)  # the positions' estimates stay (their weight ages, as at k = 0)
    assert ctl.policy.tree_stats.evidence_commit(1.0) == pytest.approx(16.0)


def test_adaptivity_off_or_pinned_runs_the_tree_wherever_the_batch_qualifies():
    """SGLANG_DFLASH_ADAPTIVE=0 + TREE=N: always the tree where it applies (benchmarks' ours-tree<N>), the full
    chain elsewhere; SGLANG_DFLASH_K=k > 0: the same; K=0: plain steps."""
    off = _controller({settings.ADAPTIVE: "0"})
    assert [off.choose(1, tree_ok=True) for _ in range(5)] == [TREE] * 5
    assert off.choose(1, tree_ok=False) == 15
    pinned = _controller({settings.K: "3"})
    assert pinned.choose(1, tree_ok=True) == TREE and pinned.choose(1, tree_ok=False) == 3
    plain = _controller({settings.K: "0"})
    assert plain.choose(1, tree_ok=True) == 0


def test_a_fixed_table_prices_the_tree(tmp_path):
    """SGLANG_DFLASH_STEP_COSTS with a "tree" entry (benchmarks/step_trace.py writes the tree's key so)."""
    table = {str(k): {"1": _chain_cost(1, k)} for k in (0, 3, 7, 15)}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**table, "tree": {"1": 1.2 * _chain_cost(1, 15)}}))
    ctl = _controller({width_control.ENV_STEP_COSTS: str(path)})
    ks = _run(ctl, 1, 300, np.random.default_rng(4), _cost_with_tree(1.2))
    assert ks[100:].count(TREE) > 150
    with pytest.raises(ValueError, match="'tree' entry without SGLANG_DFLASH_TREE"):
        WidthControls.from_env(BLOCK, env={width_control.ENV_STEP_COSTS: str(path)})


def test_the_step_trace_names_tree_steps_and_its_table_prices_them(tmp_path):
    """SGLANG_DFLASH_STEP_TRACE shows a tree step as k = "tree"; benchmarks/step_trace.py summarises it and writes
    its "tree" entry, which SGLANG_DFLASH_STEP_COSTS reads back as the tree's price."""
    from benchmarks import step_trace

    trace = tmp_path / "trace.jsonl"
    ctl = _controller({width_control.ENV_TRACE: str(trace)})
    _run(ctl, BS, 200, np.random.default_rng(5), _cost_with_tree(1.2))
    ctl._trace.close()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in rows if "k" in r]
    assert {"tree", 0, 15} <= {r["k"] for r in steps}
    costs = step_trace.step_costs(step_trace.summarise(steps))
    assert costs["tree"][str(BS)] == pytest.approx(_cost_with_tree(1.2)(BS, TREE), rel=0.01)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    table = width_control.load_step_costs(str(path), [0, 3, 7, 15], tree=TREE)
    assert table[TREE][BS] == costs["tree"][str(BS)]
