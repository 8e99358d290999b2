"""The adaptive-speculation policy (sglang_dflash/adaptive.py) on synthetic acceptance and the measured H100 costs.

Cost tables come from shared/notes/anchors.md (Qwen3-8B shape, H100, 2026-11-23): the plain step from plain
decoding's tok/s (c / tok/s: 6.8 / 7.1 / 7.9 / 8.8 ms at c = 1 / 8 / 32 / 64), a DFLASH step as that times the
measured step-cost ratio (k = 15: the full block, k = 7 / 3: SGLang's verify widths 8 / 4), k = 0 as 1.02 plain
steps (a plain step that also writes the drafter's context).
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang_dflash.adaptive import (MIN_GAIN, AcceptanceStats, StepCostTable, WidthPolicy, best_width,
                                    parse_widths)

B = 16
WIDTHS = [0, 3, 7, 15]
PLAIN_TOK_S = {1: 147.2, 8: 1128.6, 32: 4034.4, 64: 7262.2}
RATIO = {0: {1: 1.02, 8: 1.02, 32: 1.02, 64: 1.02},
         3: {1: 1.33, 8: 1.48, 32: 1.98, 64: 2.62},
         7: {1: 1.34, 8: 1.52, 32: 2.14, 64: 3.11},
         15: {1: 1.39, 8: 1.62, 32: 2.70, 64: 4.60}}
BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)  # measured points, interpolated ones and extrapolated ones


def h100_table() -> StepCostTable:
    t = StepCostTable(WIDTHS)
    for k, by_bs in RATIO.items():
        for bs, r in by_bs.items():
            t.set(bs, k, r * bs / PLAIN_TOK_S[bs])
    return t


def expected_commit(a: float | np.ndarray) -> np.ndarray:
    """E[commit | k] for per-position acceptance a (a scalar: the same at every position)."""
    a = np.broadcast_to(np.asarray(a, dtype=float), (B - 1,))
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])


def decide(a, bs: int, table: StepCostTable | None = None) -> int:
    table = table or h100_table()
    return best_width(expected_commit(a), {k: table.cost(bs, k) for k in WIDTHS})


def draw_commits(rng, a: np.ndarray, k: int, n: int) -> np.ndarray:
    """Commit lengths of n rows verified with k drafts when d_i is accepted with probability a[i-1] given its
    predecessors were: 1 + the length of the leading run of accepted drafts."""
    if k == 0:
        return np.ones(n, dtype=np.int64)
    ok = rng.random((n, k)) < a[:k]
    return 1 + np.cumprod(ok, axis=1).sum(axis=1)


# ------------------------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize("bs", BATCHES)
@pytest.mark.parametrize("a", [0.0, 0.05, 0.1])
def test_useless_drafter_turns_speculation_off_at_every_batch_size(a, bs):
    assert decide(a, bs) == 0


def test_perfect_drafter_verifies_the_full_block_at_batch_1():
    assert decide(1.0, 1) == 15


def test_good_drafter_shortens_as_the_batch_grows():
    # a = 0.8: E[commit] = 4.86 / 4.16 / 2.95 / 1 at k = 15 / 7 / 3 / 0; per cost unit at bs 1: 3.50 / 3.10 / 2.22 /
    # 0.98, at bs 64: 1.06 / 1.34 / 1.13 / 0.98
    assert decide(0.8, 1) == 15
    assert decide(0.8, 8) == 15
    assert decide(0.8, 64) == 7
    # a weak drafter speculates only where verify is nearly free
    assert decide(0.3, 1) in (3, 7)
    assert decide(0.3, 64) == 0


@pytest.mark.parametrize("a", [0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 1.0])
def test_width_never_grows_with_batch_size_on_the_h100_table(a):
    # Verify cost grows faster with bs for wider steps on this table, so a fixed drafter's best width can only fall.
    ks = [decide(a, bs) for bs in range(1, 129)]
    assert all(x >= y for x, y in zip(ks, ks[1:])), ks


def test_best_width_is_the_argmax_of_tokens_per_second_with_ties_to_the_smaller_k():
    e = [1.0, 1.5, 2.0, 2.5]
    assert best_width(e, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}) == 3
    assert best_width(e, {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5}) == 0  # all 1 token per unit: tie -> smallest
    assert best_width(e, {2: 1.0, 3: 1.25}) == 2  # 2.0 vs 2.0: tie -> smaller
    assert best_width(e, {1: 1.0, 3: 1.2}) == 3  # only the widths offered compete
    with pytest.raises(ValueError, match="k=4"):
        best_width(e, {4: 1.0})
    with pytest.raises(ValueError, match=r"costs\[1\]=0"):
        best_width(e, {1: 0.0})


# ------------------------------------------------------------------------------------------------ acceptance
def test_estimator_recovers_per_position_acceptance_from_mixed_widths():
    rng = np.random.default_rng(0)
    true_a = np.linspace(0.95, 0.6, B - 1)
    stats = AcceptanceStats(B, halflife_rows=2048)
    for _ in range(600):
        k = int(rng.choice(WIDTHS[1:]))
        stats.update(draw_commits(rng, true_a, k, 32), k)
    est = stats.acceptance()
    # positions 1..7 see every row that reaches them; 8..15 only the k = 15 third: looser there
    assert np.abs(est[:7] - true_a[:7]).max() < 0.03, (est, true_a)
    assert np.abs(est[7:] - true_a[7:]).max() < 0.06, (est, true_a)
    assert stats.rows_seen == 600 * 32
    np.testing.assert_allclose(stats.expected_commit(), expected_commit(est))


def test_rows_verified_with_few_drafts_do_not_bias_later_positions():
    # Rows with k = 1 that accept d_1 (commit 2) say nothing about d_2..: treating "all accepted" as a rejection
    # just past k, or as an acceptance of later positions, would drag a_2.. toward 0 or 1.
    rng = np.random.default_rng(1)
    true_a = np.full(B - 1, 0.5)
    stats = AcceptanceStats(B, halflife_rows=1e6, stale_halflife_steps=1e9)  # no forgetting: censoring alone
    for _ in range(200):
        stats.update(np.full(64, 2), 1)  # every k = 1 row accepted its single draft
        stats.update(draw_commits(rng, true_a, 15, 8), 15)
    est = stats.acceptance()
    assert est[0] == pytest.approx((64 + 0.5 * 8) / 72, abs=0.02)  # position 1 is observed by every row
    assert np.abs(est[1:6] - 0.5).max() < 0.06, est  # later positions: only the k = 15 rows that reached them
    # k = 0 rows are counted but observe nothing
    before, rows = stats.acceptance().copy(), stats.rows_seen
    stats.update([1, 1, 1], 0)
    np.testing.assert_allclose(stats.acceptance(), before, atol=1e-9)
    assert stats.rows_seen == rows + 3


def test_prior_and_moving_average():
    stats = AcceptanceStats(B, halflife_rows=8, prior=0.5)
    np.testing.assert_allclose(stats.acceptance(), 0.5)  # nothing seen: the prior
    np.testing.assert_allclose(stats.expected_commit()[:3], [1.0, 1.5, 1.75])
    for _ in range(20):
        stats.update([1] * 8, 3)  # d_1 always rejected
    assert stats.acceptance()[0] < 0.05  # the average holds ~12 rows at halflife 8: 0.5 / 13 is left of the prior
    np.testing.assert_allclose(stats.acceptance()[1:], 0.5)  # never reached: still the prior
    for _ in range(8):  # now always accepted: after 8 halflives the old evidence weighs 1/256
        stats.update([2] * 8, 1)
    assert stats.acceptance()[0] > 0.95
    # exactly: each observed row decays the old counts by 2^(-1/8); the prior counts as one row of 0.5
    keep = 2 ** (-1 / 8)
    rejected_rows = (1 - keep ** 160) / (1 - keep)
    accepted_rows = (1 - keep ** 64) / (1 - keep)
    observed = rejected_rows * keep ** 64 + accepted_rows
    assert stats.acceptance()[0] == pytest.approx((accepted_rows + 0.5) / (observed + 1.0), rel=1e-9)


def test_unobserved_positions_keep_their_estimate_with_less_weight():
    stats = AcceptanceStats(B, halflife_rows=256, stale_halflife_steps=64, stale_floor_rows=8)
    for _ in range(100):
        stats.update([1] * 8, 15)  # a useless drafter: d_1 always rejected, ~370 rows of evidence
    a1 = stats.acceptance()[0]
    assert a1 < 0.01
    for _ in range(5000):
        stats.update([1], 0)  # a long k = 0 phase
    # the estimate did not drift back to the prior (which would switch speculation on again by itself) ...
    assert stats.acceptance()[0] == pytest.approx(0.5 / 9, abs=0.01)  # floor 8 rows at ~0, plus the prior's row
    # ... but one accepted row now moves it a lot, where before the phase it would have moved it by ~1/370
    stats.update([16], 15)
    assert stats.acceptance()[0] > 0.14


def test_plain_step_shortcut_changes_nothing_the_full_update_would_not():
    """A k = 0 step skips numpy once every weight sits at the stale floor; its estimates must stay those of the
    full update, through phases that leave the floor (probes) and return to it."""
    fast, full = AcceptanceStats(B), AcceptanceStats(B)
    rng = np.random.default_rng(0)
    shortcuts = 0
    for step in range(3000):
        k = 15 if step % 1000 < 30 else (3 if step % 1000 == 500 else 0)  # probes, then long plain phases
        lens = rng.integers(1, k + 2, size=int(rng.integers(1, 9))) if k else np.ones(int(rng.integers(1, 9)), int)
        shortcuts += k == 0 and fast._stale_settled
        fast.update(lens, k)
        full._stale_settled = False  # the twin always takes the full path
        full.update(lens, k)
        assert np.array_equal(fast.acceptance(), full.acceptance()), step
    assert fast.rows_seen == full.rows_seen and fast._stale_settled
    assert shortcuts > 1000  # the shortcut did engage, between phases that left the floor

def test_update_rejects_commit_lengths_impossible_for_k():
    stats = AcceptanceStats(B)
    with pytest.raises(ValueError, match=r"k=3"):
        stats.update([1, 5], 3)
    with pytest.raises(ValueError, match="k=16"):
        stats.update([1], 16)
    with pytest.raises(ValueError, match="0..0"):
        stats.update([0], 3)
    stats.update(np.array([], dtype=np.int64), 3)  # an empty step is a no-op
    assert stats.rows_seen == 0


# ------------------------------------------------------------------------------------------------ step costs
def test_cost_table_interpolates_extrapolates_and_refines():
    t = StepCostTable([0, 7])
    assert not t.known()
    t.set(1, 0, 1.0)
    assert not t.known()
    with pytest.raises(ValueError, match="no step time for k=7"):
        t.cost(4, 7)
    assert t.cost(50, 0) == 1.0  # one point: constant
    t.set(8, 0, 2.4)
    t.set(32, 0, 4.0)
    t.set(1, 7, 3.0)
    assert t.known()
    assert t.cost(4, 0) == pytest.approx(1.0 + 3 / 7 * 1.4)  # between 1 and 8
    assert t.cost(20, 0) == pytest.approx(3.2)  # between 8 and 32
    assert t.cost(64, 0) == pytest.approx(4.0 + 32 * 1.6 / 24)  # beyond the last: the last segment's slope
    t.set(64, 0, 3.9)  # a noisy last point lower than the one before: extrapolation holds it, never falls
    assert t.cost(128, 0) == pytest.approx(3.9)
    t.observe(8, 0, 3.4)  # EMA toward the observation with weight 0.1
    assert t.cost(8, 0) == pytest.approx(2.4 + 0.1 * 1.0)
    t.observe(16, 7, 5.0, weight=0.5)  # absent point: starts from the interpolated cost (3.0), one EMA step
    assert t.cost(16, 7) == pytest.approx(4.0) and t.cost(8, 7) == pytest.approx(3.0 + 7 / 15 * 1.0)
    fresh = StepCostTable([0])
    fresh.observe(2, 0, 7.0)  # a width's first point is the observation itself
    assert fresh.cost(2, 0) == 7.0
    with pytest.raises(KeyError, match="k=3"):
        t.cost(1, 3)
    with pytest.raises(ValueError, match="seconds=0"):
        t.set(1, 0, 0.0)
    with pytest.raises(ValueError, match="bs=0"):
        t.cost(0, 0)


def test_h100_table_reproduces_the_measured_ratios():
    t = h100_table()
    assert t.cost(1, 0) == pytest.approx(1.02 / 147.2)
    assert t.cost(64, 15) / t.cost(64, 0) == pytest.approx(4.60 / 1.02)


# ------------------------------------------------------------------------------------------------ the policy
def simulate(policy: WidthPolicy, bs: int, a_of_step, steps: int, rng, lag: int = 0, table=None):
    """Run `steps` decode steps at batch size bs; feedback reaches the policy `lag` steps late (overlap scheduling).
    Returns the chosen k per step and the tokens per second achieved under `table`'s costs."""
    pending, ks, tokens, seconds = [], [], 0, 0.0
    for step in range(steps):
        k = policy.choose(bs)
        commits = draw_commits(rng, a_of_step(step), k, bs)
        ks.append(k)
        tokens += int(commits.sum())
        seconds += (table or policy.costs).cost(bs, k)
        pending.append((k, commits))
        if len(pending) > lag:
            kk, cc = pending.pop(0)
            policy.record(bs, kk, cc, None)
    return np.array(ks), tokens / seconds


@pytest.mark.parametrize("bs", [1, 8, 32, 64])
@pytest.mark.parametrize("a", [0.0, 0.3, 0.5, 0.7, 0.85, 1.0])
def test_policy_throughput_is_close_to_the_best_fixed_width(a, bs):
    # Stationary drafter: learning, probing and estimation noise may cost a little, but not more than 5% of what
    # the best fixed width (known only to an oracle) delivers.
    rng = np.random.default_rng(2)
    table = h100_table()
    policy = WidthPolicy(B, WIDTHS, h100_table())
    _, rate = simulate(policy, bs, lambda step: np.full(B - 1, a), 3000, rng, lag=2, table=table)
    e = expected_commit(a)
    oracle = max(bs * e[k] / table.cost(bs, k) for k in WIDTHS)
    assert rate >= 0.95 * oracle, (rate / oracle, policy.summary())


@pytest.mark.parametrize("bs", [1, 64])
def test_probing_reenables_speculation_after_a_useless_phase(bs):
    rng = np.random.default_rng(3)
    policy = WidthPolicy(B, WIDTHS, h100_table(), probe_every=16, probe_max_every=256)
    useless, good = np.zeros(B - 1), np.full(B - 1, 0.9)
    switch = 3000
    ks, _ = simulate(policy, bs, lambda s: useless if s < switch else good, 2 * switch, rng, lag=1)
    off = ks[100:switch]
    assert set(off) == {0, 15}, np.bincount(off)  # speculation off but for probes
    # probes are rare (the interval doubled, capped where probes are cheap): they add at most ~1% to the step time
    table = policy.costs
    overhead = np.mean([table.cost(bs, int(k)) for k in off]) / table.cost(bs, 0) - 1
    assert overhead < 0.015, (overhead, np.bincount(off))
    # the good drafter is found again within a few probe intervals, and then speculation stays on
    on = ks[switch + 3 * 256:]
    assert (on > 0).mean() > 0.97, np.bincount(on)
    assert np.median(on) == (15 if bs == 1 else 7)  # a = 0.9: the full block at bs 1, 7 drafts at bs 64


def test_probe_interval_doubles_while_probes_change_nothing_and_resets_when_they_raise_the_decision():
    rng = np.random.default_rng(4)
    policy = WidthPolicy(B, WIDTHS, h100_table(), probe_every=4, probe_max_every=32)
    ks, _ = simulate(policy, 64, lambda s: np.zeros(B - 1), 400, rng)
    probes = np.flatnonzero(ks == 15)
    assert list(probes[:6]) == [3, 11, 27, 59, 91, 123], probes  # gaps 8, 16, 32, 32, ...: doubled, then capped
    assert policy.probe_interval == 32
    # the drafter turns good: within a few probes the decision rises to 7 drafts (not the full block, whose own
    # branch resets the interval anyway), and the probe that raised it set the interval back to probe_every
    good = np.full(B - 1, 0.85)
    for step in range(200):
        k = policy.choose(64)
        if k == 7:
            break
        policy.record(64, k, draw_commits(rng, good, k, 64), None)
    assert k == 7 and policy.probe_interval == 4, (step, policy.summary())


def test_a_probe_that_lowers_the_decision_does_not_reset_the_interval():
    # Near a tie the decision flips with every update; only a rise (the drafter got better) earns frequent probes.
    policy = WidthPolicy(B, WIDTHS, h100_table(), probe_every=4, probe_max_every=64)
    policy.record(64, 7, np.full(64, 8), None)  # d_1..d_7 always accepted: 7 drafts at bs 64
    ks = [policy.choose(64) for _ in range(4)]
    assert ks == [7, 7, 7, 15]  # the 4th step probes
    policy.record(64, 15, np.ones(1000, dtype=np.int64), None)  # the probe finds d_1 rejected everywhere
    assert policy.decision(64) == 0
    assert policy.probe_interval == 8  # doubled as after any probe that did not raise the decision


@pytest.mark.parametrize("bs, longest_gap", [(1, 73), (64, 702)])
def test_probes_back_off_only_as_far_as_their_cost_requires(bs, longest_gap):
    # A probe at bs 1 costs 0.37 plain steps more than a k = 0 step: 0.5% of the step time buys one every ~74 steps.
    # At bs 64 it costs 3.5 plain steps: one per ~702 steps. The doubling stops there, below probe_max_every.
    rng = np.random.default_rng(6)
    policy = WidthPolicy(B, WIDTHS, h100_table(), probe_every=16, probe_max_every=1024)
    ks, _ = simulate(policy, bs, lambda s: np.zeros(B - 1), 6000, rng)
    gaps = np.diff(np.flatnonzero(ks == 15))
    assert gaps.max() == longest_gap, gaps


def test_pinned_and_adaptive_off_and_unknown_costs():
    rng = np.random.default_rng(5)
    pinned = WidthPolicy(B, WIDTHS, h100_table(), pinned=3)
    ks, _ = simulate(pinned, 64, lambda s: np.zeros(B - 1), 50, rng)
    assert set(ks) == {3} and pinned.histogram() == {0: 0, 3: 50, 7: 0, 15: 0}
    off = WidthPolicy(B, WIDTHS, h100_table(), adaptive=False)
    ks, _ = simulate(off, 64, lambda s: np.zeros(B - 1), 50, rng)
    assert set(ks) == {15}
    unknown = WidthPolicy(B, WIDTHS, StepCostTable(WIDTHS))
    assert unknown.choose(1) == 15  # nothing measured yet: the full block, as without the policy
    # only k = 0 timed (the controller never times a width the acceptance rules out): the decision is among the
    # timed widths, not the full block (which pinned a useless drafter to k = 15 under frequent prefills)
    partial = StepCostTable(WIDTHS)
    partial.set(64, 0, 0.008)
    assert WidthPolicy(B, WIDTHS, partial).choose(64) == 0
    with pytest.raises(ValueError, match="pinned k=5"):
        WidthPolicy(B, WIDTHS, h100_table(), pinned=5)
    with pytest.raises(ValueError, match=r"widths=\[0, 16\]"):
        WidthPolicy(B, [0, 16], StepCostTable([0, 16]))
    with pytest.raises(ValueError, match=r"\[3\] have no entry"):
        WidthPolicy(B, [0, 3, 15], StepCostTable([0, 15]))


def test_record_refines_costs_and_summary_reports_the_state():
    policy = WidthPolicy(B, WIDTHS, h100_table())
    k = policy.choose(4)
    assert k == 7  # the prior (a = 0.5 everywhere) says 7 drafts at bs 4 on this table
    before = policy.costs.cost(4, 7)
    policy.record(4, k, [3, 1, 2, 8], 0.5)
    # a new point at bs 4: the interpolated cost, one EMA step toward the (slow) observation
    assert policy.costs.cost(4, 7) == pytest.approx(before + 0.1 * (0.5 - before))
    line = policy.summary()
    assert "k histogram {0:0 3:0 7:1 15:0}" in line and "mean commit per k {7:3.50}" in line
    assert "a_1..a_4 0.70 " in line  # 3 of 4 rows accepted d_1 + the prior's half row: 3.5 / 5
    with pytest.raises(ValueError, match=r"record\(k=5\)"):
        policy.record(4, 5, [1], None)


def test_choose_is_cheap():
    import time

    policy = WidthPolicy(B, WIDTHS, h100_table())
    t0 = time.perf_counter()
    for _ in range(2000):
        policy.choose(37)
    assert (time.perf_counter() - t0) / 2000 < 200e-6  # microseconds per decision, well under a GPU step


# ------------------------------------------------------------------------------------------------ parse_widths
def test_parse_widths():
    assert parse_widths("0,3,7,15", 16) == [0, 3, 7, 15]
    assert parse_widths(" 0, 15 ", 16) == [0, 15]
    assert parse_widths("15", 16) == [15]
    with pytest.raises(ValueError, match=r"\[16\] outside 0..15"):
        parse_widths("0,7,16", 16)
    with pytest.raises(ValueError, match=r"must include the full block 15.*'0,3,7,15'"):
        parse_widths("0,3,7", 16)
    with pytest.raises(ValueError, match=r"strictly increasing.*'0,3,7,15'"):
        parse_widths("0,7,3,15", 16)
    with pytest.raises(ValueError, match="strictly increasing"):
        parse_widths("0,3,3,15", 16)
    with pytest.raises(ValueError, match="integer"):
        parse_widths("0,three,15", 16)
    with pytest.raises(ValueError, match="empty"):
        parse_widths("", 16)
    with pytest.raises(ValueError, match=r"\[-1\] outside"):
        parse_widths("-1,15", 16)


def test_best_width_never_trusts_a_wide_step_priced_below_a_narrow_one():
    """The H100 case (benchmarks/results/adaptive-trace-h100): k = 0 mispriced at 10.9 ms, k = 3 at 9.2 ms, and a
    useless drafter (E[commit] = 1 at every k). A k = 3 step does all of a k = 0 step's work, so it cannot be
    cheaper: the decision stays at k = 0. With acceptance that pays, the wider width still wins."""
    useless = [1.0] * 16
    assert best_width(useless, {0: 10.9e-3, 3: 9.2e-3, 7: 9.6e-3, 15: 10.7e-3}) == 0
    paying = [1.0, 1.9, 2.5, 2.9] + [3.0] * 12
    assert best_width(paying, {0: 10.9e-3, 3: 9.2e-3}) == 3


def test_a_near_useless_drafter_stays_narrow_when_the_plain_step_is_priced_too_high():
    """The H100 start-up case (benchmarks/results/fastpath-qwen3-8b-h100, two-wave run): k = 0 priced at 9.10 ms,
    k = 15 at 8.65 ms, plain steps taking ~7 ms, a random drafter (tau 1.004). The running maximum prices every width
    at 9.10 ms, and 1.004 tokens beat 1.0: without a minimum gain the full block ran. With it the plain step stays,
    and a drafter that pays still gets the block, as does one whose gain is just above MIN_GAIN."""
    costs = {0: 9.10e-3, 3: 8.9e-3, 7: 8.8e-3, 15: 8.65e-3}
    random_drafter = expected_commit(0.004)
    assert best_width(random_drafter, costs, min_gain=0.0) > 0  # the running maximum alone: a wider width
    assert best_width(random_drafter, costs) == 0
    assert best_width(expected_commit(0.8), costs) == 15
    assert best_width(expected_commit(0.6), costs) == 7  # k = 15 would commit 1.7% more: within MIN_GAIN
    just_above = [1.0] + [1.0 + 1.5 * MIN_GAIN] * 15  # k = 3 first promises 1.5 x MIN_GAIN more at the same cost
    assert best_width(just_above, costs) == 3
    with pytest.raises(ValueError, match="min_gain"):
        best_width(random_drafter, costs, min_gain=-0.1)
