"""The width controller's exploration (sglang_dflash/serving/width_control.py), driven on CPU with a synthetic
step-cost model and synthetic acceptance: which widths get timed at a new batch-size bucket, and what that costs.

Why it matters: exploration runs every width a few times per batch-size bucket. With a useless drafter, timing
k = 15 at batch 128 costs ~5 plain steps per try; a benchmark round of 256 steps lost ~10% to it on an H100
(benchmarks/results/adaptive-qwen3-8b-h100). A width the estimates already rule out must not be timed."""

import numpy as np
import pytest

from sglang_dflash.serving import width_control
from sglang_dflash.serving.width_control import EXPLORE_STEPS, WidthControls, WidthController

BLOCK = 16


def _cost(bs: int, k: int) -> float:
    """H100-like step seconds (Qwen3-8B shape): a plain step ~7 ms growing with bs; k = 15 costs ~1.5 plain steps at
    bs 1 and ~4.6 at bs 128 (a draft pass and a verify that turns compute-bound)."""
    plain = 0.0067 + 0.000025 * bs
    return plain if k == 0 else plain * (1.08 + 0.02 * k * bs ** 0.5 + 0.01 * k)


def _controller(monkeypatch) -> WidthController:
    controls = WidthControls.from_env(BLOCK, env={})
    assert controls.adaptive and controls.ks == [0, 3, 7, 15]
    ctl = WidthController(controls, BLOCK, device="cpu")
    # timings from the cost model instead of the wall clock: _run hands step_end the modelled seconds as the
    # step's start stamp, and the CPU timer is (start, end)
    monkeypatch.setattr(ctl, "_seconds", lambda timer: timer[0])
    return ctl


def _run(ctl, bs: int, steps: int, accept_rate: float, rng) -> list[int]:
    """steps decode steps at batch size bs; each draft accepted with probability accept_rate. Returns the ks."""
    ks = []
    for _ in range(steps):
        k = ctl.choose(bs)
        ks.append(k)
        # accepted drafts per row: run length of successes, capped at k
        acc = np.minimum(rng.geometric(1.0 - accept_rate, size=bs) - 1 if accept_rate < 1 else np.full(bs, k), k)
        ctl.step_end(bs, k, _cost(bs, k))
        ctl.on_verify_complete(acc.tolist(), bs)
    return ks


def test_useless_drafter_times_wide_widths_only_at_the_first_bucket(monkeypatch):
    rng = np.random.default_rng(0)
    ctl = _controller(monkeypatch)
    first = _run(ctl, 1, 200, 0.0, rng)
    assert set(first[:EXPLORE_STEPS * 4]) == {0, 3, 7, 15}  # the first bucket times everything (prior 0.5)
    for bs in (8, 32, 64, 128):
        ks = _run(ctl, bs, 256, 0.0, rng)
        wide = sum(k > 0 for k in ks)
        # the expensive widths are not explored (exploration would fill the first steps with 3 x {3, 7, 15}; k = 3
        # is cheap enough that the margin may still time it); only probes remain, whose interval starts at 16
        # steps and backs off toward a 1% cost share
        assert 15 not in ks[:4 * EXPLORE_STEPS], (bs, ks[:4 * EXPLORE_STEPS])
        extra = sum(_cost(bs, k) - _cost(bs, 0) for k in ks) / (len(ks) * _cost(bs, 0))
        assert extra < 0.025, (bs, wide, extra)


@pytest.mark.parametrize("rate", [0.6, 0.9])
def test_useful_drafter_still_times_every_width_at_each_bucket(monkeypatch, rate):
    rng = np.random.default_rng(1)
    ctl = _controller(monkeypatch)
    _run(ctl, 1, 100, rate, rng)
    ks = _run(ctl, 32, 100, rate, rng)
    for k in (0, 3, 7, 15):
        # every width is timed at the new bucket (the warm-up try plus at least one timed try); a width may stop
        # early once its own measurement rules it out
        assert ctl._explored[32, k] >= 2, (k, ks[:20])


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
