"""The width controller (sglang_dflash/serving/width_control.py), driven on CPU with a synthetic step-cost model, a
fake clock and synthetic acceptance: which widths get timed at a new batch-size bucket and what that costs, and
which cycles count as a width's step time.

Why it matters: exploration runs every width a few times per batch-size bucket. With a useless drafter, timing
k = 15 at batch 128 costs ~5 plain steps per try; a benchmark round of 256 steps lost ~10% to it on an H100
(benchmarks/results/adaptive-qwen3-8b-h100). A width the estimates already rule out must not be timed. And the
step time must be the whole cycle: on a host-bound target GPU events around the forward saw a speculative step as
nearly free, and the policy kept speculating where plain decoding was faster (smollm2-135m-h100-c1-c8)."""

import numpy as np
import pytest

from sglang_dflash.serving import width_control
from sglang_dflash.serving.width_control import EXPLORE_STEPS, OUTLIER, WidthControls, WidthController

BLOCK = 16


def _cost(bs: int, k: int) -> float:
    """H100-like step seconds (Qwen3-8B shape): a plain step ~7 ms growing with bs; k = 15 costs ~1.5 plain steps at
    bs 1 and ~4.6 at bs 128 (a draft pass and a verify that turns compute-bound)."""
    plain = 0.0067 + 0.000025 * bs
    return plain if k == 0 else plain * (1.08 + 0.02 * k * bs ** 0.5 + 0.01 * k)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _controller(monkeypatch=None, trace_path=None) -> WidthController:
    controls = WidthControls.from_env(BLOCK, env={width_control.ENV_TRACE: trace_path} if trace_path else {})
    assert controls.adaptive and controls.ks == [0, 3, 7, 15]
    ctl = WidthController(controls, BLOCK)
    ctl._clock = FakeClock()  # cycle times from the cost model instead of the wall clock
    return ctl


def _accepted(rng, bs: int, k: int, accept_rate: float) -> list[int]:
    """Accepted drafts per row: run length of successes, capped at k."""
    return np.minimum(rng.geometric(1.0 - accept_rate, size=bs) - 1 if accept_rate < 1 else np.full(bs, k),
                      k).tolist()


def _run(ctl, bs: int, steps: int, accept_rate: float, rng, cost=None, overlap: bool = False,
         prefill_every: int = 0, gpu_bound: bool = False) -> list[int]:
    """steps decode steps at batch size bs; each draft accepted with probability accept_rate; a step's cycle lasts
    cost(bs, k) on the fake clock. overlap: the scheduler reports a step's acceptance during the next step's cycle
    (SGLang's overlap loop), else before the next step starts. prefill_every: a prefill forward after every that
    many steps. gpu_bound: overlap's GPU-bound rhythm, where a step's cycle is the host waiting for the previous
    step's GPU work, so it lasts what the previous step's width costs. Returns the ks."""
    cost = cost or _cost
    ks, late, prev_k = [], None, 0
    for i in range(steps):
        k = ctl.choose(bs)
        ks.append(k)
        ctl.step_begin(bs, k)
        if late is not None:
            ctl.on_verify_complete(late, bs)
        acc = _accepted(rng, bs, k, accept_rate)
        if overlap:
            late = acc
        else:
            ctl.on_verify_complete(acc, bs)
        ctl._clock.t += cost(bs, prev_k if gpu_bound else k)
        prev_k = k
        if prefill_every and i % prefill_every == prefill_every - 1:
            ctl.interrupt()
            ctl._clock.t += 0.05  # a long prefill: must never count as a decode step's time
    if late is not None:
        ctl.on_verify_complete(late, bs)  # the scheduler reports every step
    return ks


def test_useless_drafter_times_wide_widths_only_at_the_first_bucket(monkeypatch):
    rng = np.random.default_rng(0)
    ctl = _controller(monkeypatch)
    first = _run(ctl, 1, 200, 0.0, rng)
    # the first bucket times k = 0 and the first wide width (prior 0.5: nothing seen yet); its rows, none accepted,
    # are evidence that no width can pay (AcceptanceStats.evidence_commit), so 7 and 15 are never explored: the
    # only wide steps after that are probes, at least probe_every steps apart
    assert set(first[:EXPLORE_STEPS + 2]) == {0} and 3 in first[EXPLORE_STEPS + 2:2 * (EXPLORE_STEPS + 2)]
    assert 7 not in first
    probes = [i for i, k in enumerate(first) if k == 15]
    assert probes and all(b - a >= 16 for a, b in zip(probes, probes[1:])), probes
    for bs in (8, 32, 64, 128):
        ks = _run(ctl, bs, 256, 0.0, rng)
        wide = sum(k > 0 for k in ks)
        # the expensive widths are not explored (exploration would fill the first steps with 3 x {3, 7, 15}; k = 3
        # is cheap enough that the margin may still time it); only probes remain, whose interval starts at 16
        # steps and backs off toward a 1% cost share
        assert 15 not in ks[:4 * EXPLORE_STEPS], (bs, ks[:4 * EXPLORE_STEPS])
        extra = sum(_cost(bs, k) - _cost(bs, 0) for k in ks) / (len(ks) * _cost(bs, 0))
        assert extra < 0.03, (bs, wide, extra)


@pytest.mark.parametrize("rate", [0.6, 0.9])
def test_useful_drafter_still_times_every_width_at_each_bucket(monkeypatch, rate):
    """A wide step's cost grows with the batch (_cost: k = 15 is 1.5 plain steps at batch 1, 2.9 at batch 32), so a
    width's time at batch 1 does not tell its time at batch 32: every width that could be best at the new bucket is
    timed there before the table is trusted. Since issue #45 a shape whose best possible rate cannot beat one
    already measured at the bucket is skipped (`_cannot_win`); that uses a smaller bucket's time only as a lower
    bound (a step does not get cheaper as the batch grows), never as the price, so it can skip k = 0 (it commits
    one token, and at 0.9 even its batch-1 time prices it below k = 15's rate measured at 32), never a width that
    could win."""
    rng = np.random.default_rng(1)
    ctl = _controller(monkeypatch)
    _run(ctl, 1, 100, rate, rng)
    ks = _run(ctl, 32, 100, rate, rng)
    for k in (3, 7, 15):
        # every drafted width is timed at the new bucket (the warm-up try plus at least one timed try); a width may
        # stop early once its own measurement rules it out
        assert ctl._explored[32, k] >= 2, (k, ks[:20])
    policy, costs = ctl.policy, ctl.policy.costs
    if ctl._explored[32, 0] < 2:  # k = 0 skipped: only where even its batch-1 time could not make it win at 32
        best = max(policy.expected(k) / costs.cost(32, k) for k in (3, 7, 15))
        assert policy.expected(0) / costs.cost(1, 0) < width_control.EXPLORE_MARGIN * best
    assert ctl._explored[32, 0] >= 2 or rate == 0.9
    true = {k: sum(rate ** i for i in range(k + 1)) / _cost(32, k) for k in (0, 3, 7, 15)}
    assert policy.decision(32) == max(true, key=true.get)  # the table prices the new bucket right


def _trace_cost(bs: int, k: int) -> float:
    """H200 step seconds of benchmarks/results/oracle-c8-trace-h200 (Qwen3-8B shape, GPU-bound): a plain step
    ~5.5 ms; at batch 8 k = 3, 7, 15 cost 1.28, 1.32, 1.42 plain steps, a little less at smaller batches."""
    plain = 0.0054 + 0.00002 * bs
    return plain if k == 0 else plain * (1.08 + 0.012 * k + 0.02 * bs)


def _server_start(ctl, rate: float, seed: int = 0) -> list[tuple[int, int]]:
    """A server's first 400 decode steps at c = 8 as in that trace: the batch grows 1 -> 2 -> 4 -> 8, a prefill
    every 8 steps (51 in its 399), acceptance reported a step late (overlap). Returns (batch size, k) per step."""
    rng = np.random.default_rng(seed)
    steps = []
    for bs, n in ((1, 10), (2, 5), (4, 15), (8, 370)):
        steps += [(bs, k) for k in _run(ctl, bs, n, rate, rng, cost=_trace_cost, overlap=True, prefill_every=8)]
    return steps


def _rate_vs_pinned(steps, rate: float, pinned: int) -> float:
    """Expected committed tokens per second of these steps over those of the same batches at the pinned width."""
    commit = lambda k: sum(rate ** i for i in range(k + 1))  # noqa: E731
    tokps = lambda ks: (sum(bs * commit(k) for (bs, _), k in zip(steps, ks))  # noqa: E731
                        / sum(_trace_cost(bs, k) for (bs, _), k in zip(steps, ks)))
    return tokps([k for _, k in steps]) / tokps([pinned] * len(steps))


def test_useful_drafter_explores_cheaply_at_server_start():
    """Issue #45: with an accurate drafter (full-block tau 6.5) the adaptive server was 0.945x one pinned to the full
    block at c = 8, all of it start-up exploration (k = 0 first at every bucket, then every width). Now, once the
    acceptance says the drafter is useful, a bucket times the full block first and skips shapes that cannot beat it
    even at a lower bound of their step time (`_cannot_win`). In this simulation of the trace's first 400 steps the
    steps at k < 15 drop from 67 (28 of them at k = 0; 0.958x the pinned full block) to 26 (6 at k = 0, all at batch
    1 before any draft was verified; 0.996x): k = 0 is not timed at batches 2-8 (its batch-1 time prices it out) nor
    k = 3 (k = 0's time does); k = 7 still is where only a loose bound exists (its own smaller bucket's time)."""
    ctl = _controller()
    steps = _server_start(ctl, 0.86)  # E[commit | 15] = 6.5
    low = [(bs, k) for bs, k in steps if k < 15]
    assert len(low) <= 40, low
    assert all(bs == 1 for bs, k in low if k == 0), low  # no k = 0 step once the drafter showed it is useful
    assert not any(ctl._explored[b, 0] for b in (2, 4, 8))
    assert all(ctl._explored[b, 15] >= EXPLORE_STEPS for b in (2, 4, 8))  # the full block timed at every new bucket
    assert ctl.policy.decision(8) == 15
    assert _rate_vs_pinned(steps, 0.86, 15) >= 0.98


def test_useless_drafter_server_start_is_unchanged():
    """The same start-up with a random drafter (tau ~1): nothing is skipped that was timed before (the order stays
    k = 0 first and no drafted width gets a measured rate to prune against); k = 0 is chosen everywhere, the wide
    steps are the first bucket's try of k = 3 and the probes (8, as before issue #45), >= 0.97x plain decoding."""
    ctl = _controller()
    steps = _server_start(ctl, 0.0)
    wide = [(bs, k) for bs, k in steps if k > 0]
    assert len(wide) <= 8, wide
    assert all(ctl._explored[b, 0] >= EXPLORE_STEPS for b in (1, 2, 4, 8))
    assert all(ctl.policy.decision(b) == 0 for b in (1, 2, 4, 8))
    assert _rate_vs_pinned(steps, 0.0, 0) >= 0.97


def test_a_skipped_width_is_timed_once_the_acceptance_drops():
    """k = 0 was skipped at batch 8 while the drafter was useful; when the drafter turns useless the exploration loop
    re-asks `_worth_timing` at every step (as for a width the acceptance had ruled out), so k = 0 is timed at batch 8
    and chosen."""
    ctl = _controller()
    _server_start(ctl, 0.86)
    assert not ctl._explored[8, 0]
    ks = _run(ctl, 8, 300, 0.0, np.random.default_rng(9), cost=_trace_cost, overlap=True, prefill_every=8)
    assert ctl._explored[8, 0] >= EXPLORE_STEPS
    assert ctl.policy.costs.cost(8, 0) == pytest.approx(_trace_cost(8, 0), rel=1e-6)
    assert ctl.policy.decision(8) == 0 and sum(k == 0 for k in ks[-100:]) >= 90


def test_time_floor_uses_only_bounds_that_hold(monkeypatch):
    """A shape's floor at a bucket: its own and narrower widths' points at that bucket or smaller ones; never a
    wider width's, never a bigger bucket's. Without a floor a shape is timed whatever has been measured."""
    ctl = _controller(monkeypatch)
    costs = ctl.policy.costs
    costs.set(2, 0, 0.005)
    costs.set(8, 3, 0.007)
    costs.set(16, 0, 0.009)  # a bigger bucket: bounds nothing at bucket 8
    costs.set(8, 15, 0.008)  # wider: bounds nothing for k = 7
    assert ctl._time_floor(8, 0) == 0.005  # own, smaller bucket
    assert ctl._time_floor(6, 7) == 0.007  # a narrower width at the same bucket (batch sizes 5-8)
    assert ctl._time_floor(4, 7) == 0.005  # bucket 4: only k = 0's point at 2
    assert ctl._time_floor(1, 15) is None
    for _ in range(50):
        ctl.policy.stats.update(np.full(8, 16), 15)  # every draft accepted: E[commit | 15] = 16
    assert ctl._cannot_win(8, 0, False)  # 1 / 5 ms < 0.9 * 16 / 8 ms
    assert not ctl._cannot_win(1, 0, False)  # nothing measured at bucket 1 to beat
    assert ctl._cannot_win(8, 7, False)  # 8 / 7 ms (its floor: k = 3's time) < 0.9 * 16 / 8 ms
    assert not ctl._cannot_win(8, 15, False)  # 16 / 8 ms beats k = 3's 4 / 7 ms


def test_marginal_width_ruled_out_by_interpolated_cost(monkeypatch):
    """A drafter good enough for k = 3 at batch 1 but whose k = 15 rate is far below k = 0's at batch 128 under the
    table's extrapolation: k = 15 is not timed at bucket 128, cheaper widths are."""
    ctl = _controller(monkeypatch)
    stats = ctl.policy.stats
    # a_1..a_3 high, the rest near zero: E[commit | 15] ~ E[commit | 3]
    for _ in range(50):
        stats.update(np.full(16, 4), 15)
    costs = ctl.policy.costs
    for bs in (1, 64):
        for k in (0, 3, 7, 15):
            costs.set(bs, k, _cost(bs, k) * (1 if k < 15 else 3))
    assert not ctl._worth_timing(128, 15)
    assert ctl._worth_timing(128, 3)
    assert ctl._worth_timing(128, 0)


def test_worth_timing_without_table_entries_times_everything_plausible(monkeypatch):
    ctl = _controller(monkeypatch)
    assert all(ctl._worth_timing(4, k) for k in (0, 3, 7, 15))  # prior 0.5: every width might pay
    width_control_useless = width_control.USELESS_GAIN
    for _ in range(200):
        ctl.policy.stats.update(np.ones(8, dtype=int), 15)  # nothing accepted
    assert ctl.policy.stats.expected_commit()[15] <= 1 + width_control_useless
    assert not any(ctl._worth_timing(4, k) for k in (3, 7, 15))


def _host_bound_cost(bs: int, k: int) -> float:
    """SmolLM2-135M-like cycles (H100): a plain step is ~1.6 ms of host time, a speculative one ~3.5 ms at any k
    (two graph replays with their metadata, the accept); GPU work is a small part of either."""
    return 0.0016 if k == 0 else 0.0035


@pytest.mark.parametrize("overlap, gpu_bound", [(False, False), (True, False), (True, True)])
def test_cycle_time_is_the_step_cost(overlap, gpu_bound):
    """The table holds each width's cycle, not a fraction of it nor a neighbour's, under both report orders and
    both rhythms."""
    rng = np.random.default_rng(2)
    ctl = _controller()
    # every width timed, so every width's entry is checked (with the pruning, k = 3's measured time already rules
    # out 7 and 15 here: all drafted widths cost the same and commit little more)
    ctl._cannot_win = lambda *args: False
    _run(ctl, 1, 120, 0.6, rng, cost=_host_bound_cost, overlap=overlap, gpu_bound=gpu_bound)
    costs = ctl.policy.costs
    for k in (0, 3, 7, 15):
        assert costs.has(k), k
        assert costs.cost(1, k) == pytest.approx(_host_bound_cost(1, k), rel=1e-6), k


@pytest.mark.parametrize("rate, best", [(0.45, 0), (0.75, 15)])
@pytest.mark.parametrize("overlap", [False, True])
def test_host_bound_target_speculates_only_when_it_pays(rate, best, overlap):
    """E[commit | 15] ~ 1.8 at rate 0.45: below the 2.2x cost of a speculative step, so plain steps win; at 0.75
    (E ~ 3.9) the full block wins. With GPU-event times (a speculative step looking ~free) both chose k = 15."""
    rng = np.random.default_rng(3)
    ctl = _controller()
    ks = _run(ctl, 1, 600, rate, rng, cost=_host_bound_cost, overlap=overlap)
    tail = ks[200:]
    assert sum(k == best for k in tail) / len(tail) > 0.9, (best, np.bincount(tail, minlength=16))


def test_cycles_holding_a_prefill_or_a_switch_are_not_timed():
    ctl = _controller()
    clock = ctl._clock
    recorded = []  # (k, seconds) of each step as its time is settled
    real_close = ctl._close
    ctl._close = lambda step: (recorded.append((step.k, step.seconds)), real_close(step))
    plan = [(0, 0.002, False), (0, 0.002, False), (0, 0.002, True), (0, 0.002, False), (0, 0.002, False),
            (15, 0.004, False), (15, 0.004, False), (0, 0.002, False), (0, 0.002, False)]
    for k, dt, prefill in plan:
        ctl.step_begin(1, k)
        ctl.on_verify_complete([0], 1)
        clock.t += dt
        if prefill:
            ctl.interrupt()
            clock.t += 0.05
    ctl.step_begin(1, 0)  # closes the last planned step
    timed = [s is not None for _, s in recorded]
    # step 0: no predecessor; 1: timed; 2: holds a prefill; 3: its predecessor held it; 4: timed; 5: first k=15
    # (a switch); 6: timed; 7: switch back; 8: timed
    assert [k for k, _ in recorded] == [k for k, _, _ in plan]
    assert timed == [False, True, False, False, True, False, True, False, True]
    assert [s for s in (recorded[i][1] for i in (1, 4, 8))] == pytest.approx([0.002] * 3)
    assert recorded[6][1] == pytest.approx(0.004)
    assert ctl._explored[1, 0] == 3 and ctl._explored[1, 15] == 1


def test_outlier_cycle_is_clipped():
    ctl = _controller()
    ctl.policy.costs.set(1, 0, 0.002)
    ctl._explored[1, 0] = 5  # past warm-up
    ctl.step_begin(1, 0)
    ctl._clock.t += 0.002
    ctl.step_begin(1, 0)
    ctl.on_verify_complete([0], 1)
    ctl.on_verify_complete([0], 1)
    ctl._clock.t += 1.0  # a one-second stall inside the second step's cycle
    ctl.step_begin(1, 0)
    assert ctl.policy.costs.cost(1, 0) <= 0.002 * (1 + 0.1 * (OUTLIER - 1)) + 1e-12


def test_exploration_completes_with_frequent_prefills():
    """High concurrency: a prefill every 3 steps voids two of every three cycles; every width still gets timed and
    the policy decides (no width left without a time, which would pin the full block)."""
    rng = np.random.default_rng(4)
    ctl = _controller()
    ks = _run(ctl, 64, 400, 0.0, rng, overlap=True, prefill_every=3)
    assert ctl.policy.costs.has(0)
    assert sum(k == 0 for k in ks[200:]) / 200 > 0.9


@pytest.mark.parametrize("gpu_bound", [False, True])
def test_probes_amid_plain_steps_are_timed(gpu_bound):
    """A probe sits between two plain steps, so no cycle is its own; the two cycles from its start hold one probe
    and one plain step on either rhythm (host-bound: its own work; overlap GPU-bound: the previous step's), so the
    table learns k = 15's cost from probes (which caps their frequency by cost) without a full-width run."""
    rng = np.random.default_rng(5)
    ctl = _controller()
    ks = _run(ctl, 1, 80, 0.0, rng, overlap=True, gpu_bound=gpu_bound)  # explores every width, then k = 0
    costs = ctl.policy.costs
    true, wrong = _cost(1, 15), 2 * _cost(1, 15)
    costs.set(1, 15, wrong)  # forget what exploration measured: only probes can correct this
    before = ctl._explored[1, 15]
    ks = _run(ctl, 1, 2000, 0.0, rng, overlap=True, gpu_bound=gpu_bound)
    probes = sum(k == 15 for k in ks)
    assert probes >= 5 and ctl._explored[1, 15] - before >= probes - 1, probes  # each timed (the last may be open)
    assert abs(costs.cost(1, 15) - true) < 0.6 * (wrong - true), (costs.cost(1, 15), true, probes)
    assert costs.cost(1, 0) == pytest.approx(_cost(1, 0), rel=1e-6)


def test_entry_seeded_by_a_stall_is_retimed():
    """The H100 failure: the first k = 0 cycles after start-up were ~45x a plain step; the table said 75 ms for k = 0
    and it was never chosen again. The exploration median ignores one such cycle, and an entry that is still wrong
    is retimed (first after REFRESH_FIRST steps), even when the table says the width cannot win."""
    rng = np.random.default_rng(6)
    ctl = _controller()
    stalls = iter([0.075] * 5)  # every k = 0 cycle of the first exploration stalls
    cost = lambda bs, k: next(stalls, _host_bound_cost(bs, k)) if k == 0 else _host_bound_cost(bs, k)
    ks = _run(ctl, 1, 150, 0.45, rng, cost=cost, overlap=True)
    assert ctl.policy.costs.cost(1, 0) > 0.02 and ks[-50:].count(0) < 10  # poisoned: k = 0 looks 20x dearer
    ks = _run(ctl, 1, width_control.REFRESH_FIRST + 400, 0.45, rng, cost=cost, overlap=True)
    assert ctl.policy.costs.cost(1, 0) == pytest.approx(_host_bound_cost(1, 0), rel=0.05)
    assert ks[-300:].count(0) > 270  # plain steps win at this acceptance, once the table knows what they cost


def test_one_stalled_exploration_cycle_does_not_seed_the_table():
    rng = np.random.default_rng(7)
    ctl = _controller()
    stalls = iter([0.0016, 0.0016, 0.075])  # the third k = 0 cycle (second timed try) stalls
    cost = lambda bs, k: next(stalls, _host_bound_cost(bs, k)) if k == 0 else _host_bound_cost(bs, k)
    _run(ctl, 1, 60, 0.45, rng, cost=cost, overlap=True)
    assert ctl.policy.costs.cost(1, 0) == pytest.approx(_host_bound_cost(1, 0), rel=1e-6)


def test_step_trace_records_every_reported_step(tmp_path):
    """SGLANG_DFLASH_STEP_TRACE: one JSON line per step whose feedback is in, with what the table was charged."""
    import json

    path = tmp_path / "trace.jsonl"
    ctl = _controller(trace_path=str(path))
    rng = np.random.default_rng(0)
    _run(ctl, 2, 40, 0.5, rng, overlap=True, prefill_every=10)
    ctl.step_begin(2, 0)  # closes the last step
    ctl._trace.flush()
    head, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert head["controls"].startswith("adaptive") and len(rows) == 40 and {r["bs"] for r in rows} == {2}
    timed = [r for r in rows if r["timed_ms"] is not None]
    assert timed and all(r["cycle_ms"] is not None for r in timed)
    # a step whose cycle held a prefill is never timed
    assert all(r["timed_ms"] is None for r in rows if r["cycle_ms"] is None)
    assert all(r["commit"] >= 1 for r in rows)


def test_step_trace_reaches_the_file_while_the_server_runs(tmp_path, monkeypatch):
    """Benchmarks stop a server with a kill, so the trace cannot wait for a clean exit to be flushed (one oracle run
    kept only its first 64 KB): every TRACE_FLUSH_S, the lines so far are in the file."""
    path = tmp_path / "trace.jsonl"
    ctl = _controller(trace_path=str(path))
    monkeypatch.setattr(width_control, "TRACE_FLUSH_S", 0.0)
    _run(ctl, 2, 20, 0.5, np.random.default_rng(0), overlap=True)
    # the header and every step whose feedback is in (overlap: the last two await theirs), not flushed by the test
    assert len(path.read_text().splitlines()) >= 1 + 18
    monkeypatch.setattr(width_control, "TRACE_FLUSH_S", 3600.0)
    before = len(path.read_text().splitlines())
    _run(ctl, 2, 5, 0.5, np.random.default_rng(1), overlap=True)
    assert len(path.read_text().splitlines()) == before  # buffered between flushes: no write per step


# ------------------------------------------------------------------------------ tensor parallelism: one decision
class _Broadcast:
    """In-process stand-in for the TP group's CPU broadcast: rank 0's calls publish, rank 1's read the latest
    publication (the two controllers are stepped in lockstep, rank 0 first, as the ranks' collectives pair up)."""

    def __init__(self):
        self.published = []

    def rank(self, r: int):
        def broadcast(obj):
            if r == 0:
                self.published.append(obj)
                return obj
            return self.published[-1]
        return broadcast


def _lockstep(ctls, bs_schedule, clocks, accept_rate: float, seed: int = 0) -> list[list[int]]:
    """Step every rank's controller through the same steps (same batch sizes, same acceptance reports, as the
    scheduler gives every rank), each rank on its own step-cost clock. Returns each rank's chosen ks."""
    rng = np.random.default_rng(seed)
    chosen = [[] for _ in ctls]
    for bs in bs_schedule:
        ks = [ctl.choose(bs) for ctl in ctls]
        for r, (ctl, k) in enumerate(zip(ctls, ks)):
            chosen[r].append(k)
            ctl.step_begin(bs, k)
        acc = _accepted(rng, bs, max(ks), accept_rate)
        for ctl, k, clock in zip(ctls, ks, clocks):
            ctl.on_verify_complete([min(a, k) for a in acc], bs)
            ctl._clock.t += clock(bs, k)
    return chosen


def _tp_controllers(shared: bool):
    box = _Broadcast()
    ctls = []
    for r in range(2):
        share = width_control.TableShare(r, box.rank(r)) if shared else None
        ctl = WidthController(WidthControls.from_env(BLOCK, env={}), BLOCK, share=share)
        ctl._clock = FakeClock()
        ctls.append(ctl)
    return ctls


@pytest.mark.parametrize("accept_rate", [0.0, 0.6, 0.95])
def test_tp_ranks_choose_the_same_width_whatever_their_clocks_say(accept_rate):
    """Two ranks whose clocks disagree (rank 1 sees plain steps 40% dearer and wide steps 30% cheaper, plus jitter:
    the table it would build prefers other widths) still choose the same k at every step, because decisions read
    only rank 0's shared table; and the run is not stuck at one width (the decision really moves)."""
    jitter = np.random.default_rng(7)
    clocks = [_cost, lambda bs, k: _cost(bs, k) * (1.4 if k == 0 else 0.7) * jitter.uniform(0.8, 1.25)]
    schedule = [1] * 300 + [8] * 300 + [3] * 200 + [32] * 300
    ks0, ks1 = _lockstep(_tp_controllers(shared=True), schedule, clocks, accept_rate)
    assert ks0 == ks1
    assert len(set(ks0)) > 1


def test_tp_ranks_without_the_share_diverge():
    """The same run without the share: each rank decides from its own clock and the ranks part ways (so the test
    above can fail)."""
    jitter = np.random.default_rng(7)
    clocks = [_cost, lambda bs, k: _cost(bs, k) * (1.4 if k == 0 else 0.7) * jitter.uniform(0.8, 1.25)]
    schedule = [1] * 300 + [8] * 300 + [3] * 200 + [32] * 300
    ks0, ks1 = _lockstep(_tp_controllers(shared=False), schedule, clocks, 0.6)
    assert ks0 != ks1


def test_tp_share_runs_at_agreed_steps_only():
    """The share is a collective: it must happen at the same step counts on every rank, rarely once the table is
    filled."""
    due = [s for s in range(4096) if width_control._share_due(s)]
    assert due[:3] == [0, 16, 32] and all(s % width_control.SHARE_EVERY == 0 for s in due
                                          if s >= width_control.SHARE_FIRST_UNTIL)
    assert len(due) < 4096 / 30


# ------------------------------------------------------------------------- a fixed table: reproducible choices
def _fixed_table(tmp_path, ks=(0, 3, 7, 15)):
    import json

    table = {k: {bs: _cost(bs, k) for bs in (1, 8, 32)} for k in ks}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({str(k): {str(bs): t for bs, t in v.items()} for k, v in table.items()}))
    return str(path)


def test_a_fixed_step_time_table_makes_the_choices_repeat_whatever_the_clock(tmp_path):
    """SGLANG_DFLASH_STEP_COSTS: no exploration and no timing, so two runs on clocks that disagree (and a run on
    either) choose the same k at every step; without it the same two runs choose differently."""
    env = {width_control.ENV_STEP_COSTS: _fixed_table(tmp_path)}
    jitter = np.random.default_rng(3)
    clocks = [_cost, lambda bs, k: _cost(bs, k) * (1.5 if k == 0 else 0.6) * jitter.uniform(0.7, 1.4)]
    schedule = [1] * 200 + [8] * 200 + [32] * 200
    runs = []
    for clock in clocks:
        ctl = WidthController(WidthControls.from_env(BLOCK, env=env), BLOCK)
        ctl._clock = FakeClock()
        assert "fixed step-time table" in ctl.controls.describe()
        runs.append(_lockstep([ctl], schedule, [clock], accept_rate=0.6)[0])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
    free = []
    for clock in clocks:
        ctl = WidthController(WidthControls.from_env(BLOCK, env={}), BLOCK)
        ctl._clock = FakeClock()
        free.append(_lockstep([ctl], schedule, [clock], accept_rate=0.6)[0])
    assert free[0] != free[1]


def test_a_fixed_table_must_cover_every_width(tmp_path):
    env = {width_control.ENV_STEP_COSTS: _fixed_table(tmp_path, ks=(0, 15))}
    with pytest.raises(ValueError, match=r"no step time for widths \[3, 7\].*Fix"):
        WidthControls.from_env(BLOCK, env=env)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON table.*Fix"):
        WidthControls.from_env(BLOCK, env={width_control.ENV_STEP_COSTS: str(tmp_path / "bad.json")})
