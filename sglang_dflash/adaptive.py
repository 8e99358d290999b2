"""Adaptive speculation: how many drafts to verify in the next decode step (issue #9).

Terms. Block size B (the drafter's, = `--speculative-num-draft-tokens`). A step "with k drafts" verifies k + 1
tokens [bonus, d_1..d_k] and commits 1..k+1 of them; k = 0 is a plain decode step (it still feeds the drafter's
context, so speculation can resume at any time). `widths` are the k values the worker has a kernel / graph for.

The decision (`best_width`, a pure function): maximise committed tokens per second of the whole batch,

    k* = argmax_k  bs * E[commit | k] / t(bs, k)      (bs is common to every k, so it drops out of the argmax)

with E[commit | k] = 1 + sum_{i<=k} prod_{j<=i} a_j from per-position conditional acceptance a_i
(`AcceptanceStats`, an exponential moving average over verified rows) and t(bs, k) the seconds of one step
(`StepCostTable`, measured at startup and refined online). `WidthPolicy` wraps the three with the operator
controls (pin k, adaptivity off) and probing: while the decision is below the largest width, every so often a step
runs at the largest width, because the statistics of positions the policy stopped verifying can only be refreshed by
verifying them.

Trees (SGLANG_DFLASH_TREE, issue #38 item 4): the draft tree is one more shape with key B (`tree_key`), priced by
`best_shape` from its own step time in the same table and its own expected commit (`TreeStats`: tree rows only,
never the chain's per-position statistics), probed by the same rule while the decision is something else.

Host-side only and deliberately light: numpy and the standard library, no torch, no SGLang. A decision costs tens of
microseconds, and the feedback (`record`) may lag the decision by a step or two (overlap scheduling).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Sequence

import numpy as np


# ------------------------------------------------------------------------------------------------ widths
def parse_widths(text: str, block_size: int, name: str = "widths") -> list[int]:
    """'0,3,7,15' -> [0, 3, 7, 15]: the verify widths (drafts per step) an operator allows.

    Each must be an integer in 0..block_size-1, strictly increasing, and the list must include block_size - 1 (the
    full block: it is the ceiling and the probing width)."""
    top = block_size - 1
    example = ",".join(str(k) for k in sorted({0, top // 4, top // 2, top}))
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(p == "" for p in parts):
        raise ValueError(f"{name}={text!r}: expected a comma-separated list of draft counts such as {example!r} "
                         f"(block size {block_size}); fix: remove empty entries")
    try:
        widths = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{name}={text!r}: every entry must be an integer number of drafts, "
                         f"e.g. {example!r}") from None
    bad = [k for k in widths if not 0 <= k <= top]
    if bad:
        raise ValueError(f"{name}={text!r}: {bad} outside 0..{top} (a step verifies at most block_size - 1 = {top} "
                         f"drafts); fix: use values in 0..{top}")
    if widths != sorted(set(widths)):
        raise ValueError(f"{name}={text!r}: entries must be strictly increasing without repeats; "
                         f"fix: {','.join(map(str, sorted(set(widths))))!r}")
    if widths[-1] != top:
        raise ValueError(f"{name}={text!r}: must include the full block {top} (block size {block_size}; it is the "
                         f"ceiling and the probing width); fix: {','.join(map(str, widths + [top]))!r}")
    return widths


# ------------------------------------------------------------------------------------------------ acceptance
class AcceptanceStats:
    """Per-position conditional acceptance a_i = P(d_i accepted | d_1..d_{i-1} accepted), i = 1..B-1, smoothed by
    an exponential moving average over verified rows (a prior for positions never observed).

    Position i is observed by a row verified with k drafts iff i <= k and the row reached it (d_1..d_{i-1}
    accepted, commit_len >= i); it is accepted iff commit_len >= i + 1. Rows verified with few drafts therefore say
    nothing about later positions (censoring).

    Each position keeps decayed counts (accepted, observed); every observation decays the old ones by
    2^(-1/halflife_rows). The estimate is (accepted + prior * PRIOR_ROWS) / (observed + PRIOR_ROWS): the prior
    counts as PRIOR_ROWS rows, so one row already moves an unobserved position most of the way.

    Staleness: a position that a step does not observe keeps its estimate, but its weight decays by
    2^(-1/stale_halflife_steps) per such step, down to stale_floor_rows rows. So a k = 0 phase does not drift back
    to the prior (that would switch a useless drafter back on by itself), yet after it the next probe's rows count
    against a few rows of old evidence, not hundreds: one probe row at batch size 1 can move the estimate.
    """

    PRIOR_ROWS = 1.0

    def __init__(self, block_size: int, halflife_rows: float = 256.0, prior: float = 0.5,
                 stale_halflife_steps: float = 64.0, stale_floor_rows: float = 8.0):
        if block_size < 2:
            raise ValueError(f"block_size={block_size}: a DFlash block has the bonus token plus at least one draft")
        if not halflife_rows > 0:
            raise ValueError(f"halflife_rows={halflife_rows}: must be > 0 (rows over which old evidence halves)")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior={prior}: an acceptance probability must lie in [0, 1]")
        if not stale_halflife_steps > 0 or not stale_floor_rows >= 0:
            raise ValueError(f"stale_halflife_steps={stale_halflife_steps}, stale_floor_rows={stale_floor_rows}: "
                             "need a halflife > 0 and a floor >= 0")
        self.block_size, self.halflife_rows, self.prior = block_size, float(halflife_rows), float(prior)
        self._keep = 2.0 ** (-1.0 / self.halflife_rows)  # decay per observed row
        self._stale_keep = 2.0 ** (-1.0 / stale_halflife_steps)  # decay per step that does not observe a position
        self._floor = float(stale_floor_rows)
        self._accepted = np.zeros(block_size - 1)
        self._observed = np.zeros(block_size - 1)
        self._expected: np.ndarray | None = None  # cache of expected_commit(), dropped on update
        self._evidence: np.ndarray | None = None  # cache of evidence_commit(), dropped with it
        self._stale_settled = True  # every position's weight at or below the stale floor (a k = 0 step is a no-op)
        self.rows_seen = 0

    def update(self, commit_lens, k: int) -> None:
        """Feed the rows of one step verified with k drafts. commit_lens: 1-D ints in 1..k+1."""
        if not 0 <= k < self.block_size:
            raise ValueError(f"k={k}: drafts per step must be in 0..{self.block_size - 1}")
        if k == 0 and self._stale_settled:
            # a plain step observes nothing, and every weight already sits at the stale floor: nothing changes but
            # the row count (the steady state of a k = 0 phase; numpy's per-call cost is host time on every step)
            self.rows_seen += len(commit_lens)
            return
        c = np.asarray(commit_lens, dtype=np.int64).reshape(-1)
        if c.size == 0:
            return
        lo, hi = int(c.min()), int(c.max())
        if lo < 1 or hi > k + 1:
            raise ValueError(f"commit_lens in {lo}..{hi} with k={k}: a step with k drafts commits 1..{k + 1} tokens "
                             "per row; fix: pass the k the rows were verified with")
        self.rows_seen += int(c.size)
        # reached[i] = rows with commit_len >= i, i = 0..k+1 (reversed cumulative count)
        reached = np.cumsum(np.bincount(c, minlength=k + 2)[::-1])[::-1]
        observed = np.zeros(self.block_size - 1)
        accepted = np.zeros(self.block_size - 1)
        observed[:k] = reached[1:k + 1]  # position i (1..k) observed iff commit_len >= i
        accepted[:k] = reached[2:k + 2]  # ... and accepted iff commit_len >= i + 1
        # As if the step's rows came one after another: the old counts decay once per observing row, and the new
        # rows share the weights of n consecutive rows, (1 + keep + .. + keep^(n-1)) / n each (order-free).
        seen = observed > 0
        decay = self._keep ** observed
        share = np.divide(1.0 - decay, (1.0 - self._keep) * observed, out=np.zeros_like(observed), where=seen)
        # positions this step did not observe: same estimate, less weight (not below the floor)
        weight = self._observed
        stale = np.where(weight > self._floor, np.maximum(self._stale_keep, self._floor / np.maximum(weight, 1e-300)),
                         1.0)
        decay = np.where(seen, decay, stale)
        self._accepted = self._accepted * decay + accepted * share
        self._observed = self._observed * decay + observed * share
        self._expected = self._evidence = None
        self._stale_settled = bool((self._observed <= self._floor).all())

    def acceptance(self) -> np.ndarray:
        """[B-1] a_1..a_{B-1}."""
        return (self._accepted + self.prior * self.PRIOR_ROWS) / (self._observed + self.PRIOR_ROWS)

    def expected_commit(self) -> np.ndarray:
        """[B]: index k -> E[committed tokens | k drafts] = 1 + sum_{i<=k} prod_{j<=i} a_j."""
        if self._expected is None:
            self._expected = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.acceptance()))])
        return self._expected

    def evidence_commit(self) -> np.ndarray:
        """[B]: E[committed tokens | k drafts] from the observed rows alone; a position with under one row of
        (decayed) evidence keeps the prior. The smoothed estimate cannot tell a useless drafter from an unknown one:
        at the stale floor (8 rows) a position that never accepted still reads prior / 9 = 0.056, which put
        E[commit | 15] at ~1.1 with a random drafter and kept timing widths that could not pay (issue #34). The
        question "could any width pay?" is about evidence, so it reads this."""
        if self._evidence is None:
            obs = self._observed
            a = np.where(obs >= 1.0, self._accepted / np.maximum(obs, 1e-300), self.prior)
            self._evidence = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])
        return self._evidence

    def has_evidence(self) -> bool:
        """At least one (decayed) row has verified a draft: evidence_commit is more than the prior. The weight never
        decays below the stale floor, so once true it stays true."""
        return bool(self._observed[0] >= 1.0)



class TreeStats:
    """E[committed tokens | tree step]: a decayed mean of the tree steps' commit lengths (issue #38 item 4).

    A tree's acceptance has no per-position form the chain's statistics could hold (a row commits along whichever
    path it accepted), so tree rows go here and never into AcceptanceStats. Same rules as AcceptanceStats: every
    row decays the old ones by 2^(-1/halflife_rows); a step that runs no tree decays their weight by
    2^(-1/stale_halflife_steps), down to stale_floor_rows, so after a chain phase the next tree probe's rows count
    against a few rows of old evidence. The prior (one row) is given by the caller at read time: the chain's
    E[commit | B-1] (a tree of N nodes holds a path as deep as the chain's), so before its first rows the tree
    is priced like the full chain and can be explored."""

    PRIOR_ROWS = 1.0

    def __init__(self, halflife_rows: float = 256.0, stale_halflife_steps: float = 64.0,
                 stale_floor_rows: float = 8.0):
        if not halflife_rows > 0 or not stale_halflife_steps > 0 or not stale_floor_rows >= 0:
            raise ValueError(f"halflife_rows={halflife_rows}, stale_halflife_steps={stale_halflife_steps}, "
                             f"stale_floor_rows={stale_floor_rows}: need halflives > 0 and a floor >= 0")
        self._keep = 2.0 ** (-1.0 / halflife_rows)
        self._stale_keep = 2.0 ** (-1.0 / stale_halflife_steps)
        self._floor = float(stale_floor_rows)
        self._sum = 0.0  # decayed sum of commit lengths
        self._rows = 0.0  # decayed row count (the evidence's weight)
        self.rows_seen = 0

    def update(self, commit_lens) -> None:
        """Feed the rows of one tree step. commit_lens: 1-D ints >= 1."""
        c = np.asarray(commit_lens, dtype=np.int64).reshape(-1)
        if c.size == 0:
            return
        if int(c.min()) < 1:
            raise ValueError(f"commit_lens {c.tolist()}: a tree step commits at least the bonus token per row")
        n = int(c.size)
        decay = self._keep ** n
        share = (1.0 - decay) / ((1.0 - self._keep) * n)  # n consecutive rows' weights, order-free (AcceptanceStats)
        self._sum = self._sum * decay + float(c.sum()) * share
        self._rows = self._rows * decay + n * share
        self.rows_seen += n

    def skip(self) -> None:
        """A step that ran no tree: same estimate, less weight (not below the floor)."""
        if self._rows > self._floor:
            scale = max(self._stale_keep, self._floor / self._rows)
            self._sum *= scale
            self._rows *= scale

    def expected_commit(self, prior: float) -> float:
        """The smoothed estimate; prior: what an unobserved tree is assumed to commit (one row's weight)."""
        return (self._sum + prior * self.PRIOR_ROWS) / (self._rows + self.PRIOR_ROWS)

    def evidence_commit(self, prior: float) -> float:
        """From the observed rows alone; the prior until one row of (decayed) evidence (AcceptanceStats'
        evidence_commit: the question "could a tree pay?" is about evidence)."""
        return self._sum / self._rows if self._rows >= 1.0 else prior


# ------------------------------------------------------------------------------------------------ step cost
class StepCostTable:
    """Seconds per step t(bs, k), for the verify widths that have a kernel/graph (`widths`, k values, 0 included), at
    measured batch sizes; interpolated linearly in bs between measured points (extrapolated linearly beyond the last),
    refined online by an EMA.

    Below the first measured batch size the first point's cost is used (a step never gets cheaper than at the
    smallest measured batch, and a downward extrapolation could turn negative); beyond the last point the last
    segment's slope is followed, never below the last point's cost (noise must not make large batches free).
    """

    def __init__(self, widths: Sequence[int]):
        widths = [int(k) for k in widths]
        if not widths or widths != sorted(set(widths)) or widths[0] < 0:
            raise ValueError(f"widths={widths}: need non-negative draft counts, strictly increasing; "
                             "fix: e.g. [0, 3, 7, 15]")
        self.widths = widths
        self._bs: dict[int, list[int]] = {k: [] for k in widths}  # sorted batch sizes per width
        self._sec: dict[int, list[float]] = {k: [] for k in widths}

    def _check(self, bs: int, k: int, seconds: float | None = None) -> None:
        if k not in self._bs:
            raise KeyError(f"k={k} has no step-cost entry; this table covers widths {self.widths}")
        if bs < 1:
            raise ValueError(f"bs={bs}: batch size must be >= 1")
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds={seconds} for bs={bs}, k={k}: a step time must be finite and > 0")

    def set(self, bs: int, k: int, seconds: float) -> None:
        """A startup measurement (replaces any value at (bs, k))."""
        self._check(bs, k, seconds)
        xs, ys = self._bs[k], self._sec[k]
        i = bisect.bisect_left(xs, bs)
        if i < len(xs) and xs[i] == bs:
            ys[i] = float(seconds)
        else:
            xs.insert(i, bs)
            ys.insert(i, float(seconds))

    def observe(self, bs: int, k: int, seconds: float, weight: float = 0.1) -> None:
        """Online refinement: move the (bs, k) point toward the observation. An absent point starts from the
        width's interpolated cost and takes the same EMA step: one slow cycle at a batch size never seen before (a
        first graph replay there, a stall) must not become that size's price. On an H100 it did: one such cycle put
        k = 0 at 10.9 ms at batch 8, where its steps took 7.3 ms, and k = 0 was not chosen there again. The first
        point of a width is the observation itself (there is nothing to interpolate)."""
        self._check(bs, k, seconds)
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight={weight}: the EMA step must lie in (0, 1]")
        xs, ys = self._bs[k], self._sec[k]
        i = bisect.bisect_left(xs, bs)
        if i < len(xs) and xs[i] == bs:
            ys[i] += weight * (float(seconds) - ys[i])
        else:
            value = float(seconds)
            if xs:
                start = self.cost(bs, k)
                value = start + weight * (value - start)
            xs.insert(i, bs)
            ys.insert(i, value)

    def cost(self, bs: int, k: int) -> float:
        self._check(bs, k)
        xs, ys = self._bs[k], self._sec[k]
        if not xs:
            raise ValueError(f"no step time for k={k} at any batch size; fix: set() or observe() it first "
                             "(known() says whether every width has one)")
        if len(xs) == 1 or bs <= xs[0]:
            return ys[0]
        if bs >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(slope, 0.0) * (bs - xs[-1])
        i = bisect.bisect_right(xs, bs)  # xs[i-1] <= bs < xs[i]
        f = (bs - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + f * (ys[i] - ys[i - 1])

    def has(self, k: int) -> bool:
        """Width k has at least one point."""
        return bool(self._bs.get(k))

    def points(self, k: int) -> list[tuple[int, float]]:
        """Width k's points (batch size, seconds), ascending in batch size: what was measured, not interpolated."""
        self._check(1, k)
        return list(zip(self._bs[k], self._sec[k]))

    def known(self) -> bool:
        """Every width has at least one point."""
        return all(self._bs[k] for k in self.widths)


# ------------------------------------------------------------------------------------------------ the decision
# A wider width must promise at least this much more throughput than the best narrower one. The step-cost table is
# measured on the host clock and the acceptance is an estimate: a gain smaller than their noise is not a gain.
MIN_GAIN = 0.02
# E[commit] <= 1 + this: no drafted shape can pay (none costs less than a plain step): not timed, not probed
USELESS_GAIN = 0.02


def best_width(expected_commit: Sequence[float], costs: dict[int, float], min_gain: float = MIN_GAIN) -> int:
    """THE decision, a pure function: argmax over k in costs of expected_commit[k] / cost(k) (tokens per second per
    request; the batch throughput is bs times that, so bs enters only through the costs), where a wider k replaces a
    narrower one only if its rate is more than (1 + min_gain) times that one's. Ties -> the smaller k.

    cost(k) is the running maximum of costs over the widths up to k: a step that verifies more tokens does all the
    work of one that verifies fewer, so a table pricing k below a narrower width is measurement noise, and taking
    it at its word would pick a useless width over plain steps (on an H100 a mispriced k = 0 had k = 3, committing
    1.0 tokens per step, chosen for 400 steps). The running maximum alone still hands a near-useless drafter the full
    block whenever k = 0 is the width priced too high: both then cost the same, and an expected commit of 1.004
    tokens beats 1.0 (on an H100 a k = 0 priced at 9.10 ms, plain steps taking ~7, ran 154 of the first 269 steps at
    k = 15 with a random drafter). min_gain keeps such a step narrow: it must pay for itself by more than the noise."""
    if not costs:
        raise ValueError("costs is empty: give the step time of at least one width")
    if not min_gain >= 0:
        raise ValueError(f"min_gain={min_gain}: the gain a wider width must promise is a fraction >= 0")
    best_k, best_rate, envelope = -1, -math.inf, 0.0
    for k in sorted(costs):
        if not 0 <= k < len(expected_commit):
            raise ValueError(f"k={k} outside 0..{len(expected_commit) - 1} covered by expected_commit")
        if not costs[k] > 0:
            raise ValueError(f"costs[{k}]={costs[k]}: a step time must be > 0")
        envelope = max(envelope, costs[k])
        rate = expected_commit[k] / envelope
        # strict, and by more than min_gain: on a tie or a gain within the noise the smaller k (cheaper, fewer wasted
        # target FLOPs) stays
        if rate > best_rate * (1.0 + min_gain):
            best_k, best_rate = k, rate
    return best_k



def best_shape(expected_commit: Sequence[float], costs: dict[int, float], tree_commit: float | None = None,
               min_gain: float = MIN_GAIN) -> int:
    """best_width with the draft tree as one more shape, a pure function. The tree's key is B = len(expected_commit)
    (one past the longest chain; ``tree_key``): costs[B] is a tree step's time and tree_commit its expected commit.
    The tree is chosen only if its rate beats the best chain's by more than min_gain (it is the most expensive
    shape to run: a draft pass, a tree build and a verify of N nodes), and it is priced at least as a plain step
    (never cheaper than k = 0, the running-maximum rule of best_width). Without a tree entry (or tree_commit None)
    this is best_width."""
    tree = len(expected_commit)
    chain = {k: c for k, c in costs.items() if k != tree}
    if tree not in costs or tree_commit is None:
        return best_width(expected_commit, chain, min_gain)
    if not costs[tree] > 0:
        raise ValueError(f"costs[tree]={costs[tree]}: a step time must be > 0")
    tree_rate = tree_commit / max(costs[tree], chain.get(0, 0.0))
    if not chain:
        return tree
    k = best_width(expected_commit, chain, min_gain)
    chain_rate = expected_commit[k] / max(c for j, c in chain.items() if j <= k)
    return tree if tree_rate > chain_rate * (1.0 + min_gain) else k


def tree_key(block_size: int) -> int:
    """The tree's key in k-indexed tables (step costs, histograms, the trace): B, one past the longest chain."""
    return block_size


# ------------------------------------------------------------------------------------------------ the policy
class WidthPolicy:
    """Chooses the shape of each decode step (k drafts of the chain, or the draft tree); learns from the steps it is
    told about.

    Probing: while the decision is below the largest width, every `interval` steps a step runs at the largest width
    (its rows refresh the acceptance of positions the policy stopped verifying, e.g. after a useless phase). The
    interval starts at `probe_every`, doubles after each probe that changes nothing, up to `probe_max_every`, and
    resets to `probe_every` when a probe raises the decision (AcceptanceStats' staleness rule makes that possible
    from one probe: its rows count against a few rows of old evidence, not hundreds). A probe that lowers the
    decision does not reset the interval: probing exists to find a drafter that got better, and near a tie between
    two widths the decision flips with every update, which would keep full-width probes (4.5 plain steps each at
    batch 64 on an H100) frequent.

    The doubling is also capped by cost: the interval never exceeds the one at which probes add `probe_budget`
    (0.5%) to the step time. On the H100 table that is ~74 steps at batch 1 (a probe costs 0.37 of a plain step
    more than a k = 0 step) and ~700 at batch 64 (3.5 plain steps more), so exploration costs about 0.5% at any
    batch size: small batches keep re-checking a marginal drafter they switched off after an unlucky run of rows
    (without the cap it stays off for up to probe_max_every steps), large batches, where a probe is expensive, probe
    rarely. The budget was 1% until the adaptive floor (issue #34: >= 0.97x plain decoding with a useless drafter)
    showed every percent spent on probes; at batch 1 on an 8B target 74 steps are still half a second.

    Trees (tree=True, SGLANG_DFLASH_TREE; issue #38 item 4): the draft tree is one more shape, key B (`tree_key`),
    chosen by `best_shape` where the caller says the batch may take one (`choose(bs, tree_ok=True)`). Its
    expected commit is learned from tree steps alone (`TreeStats`, prior: the chain's E[commit | B-1]); its rows
    never enter the chain's per-position statistics. While the decision is not the tree, a tree probe runs by the
    same interval rule (own doubling state, the cost cap), as long as some evidence says a tree could commit more
    than one token per step. Probes that involve the tree are priced by the rate they lose: a probe's time less
    the time its expected tokens take at the decision's rate (a tree probe runs longer but commits more).
    """

    def __init__(self, block_size: int, widths: Sequence[int], costs: StepCostTable,
                 stats: AcceptanceStats | None = None, pinned: int | None = None, adaptive: bool = True,
                 probe_every: int = 16, probe_max_every: int = 1024, probe_budget: float = 0.005,
                 tree: bool = False, tree_stats: TreeStats | None = None):
        widths = [int(k) for k in widths]
        if not widths or widths != sorted(set(widths)) or widths[0] < 0 or widths[-1] > block_size - 1:
            raise ValueError(f"widths={widths}: need strictly increasing draft counts in 0..{block_size - 1} "
                             f"(block size {block_size}); fix: e.g. parse_widths('0,3,7,{block_size - 1}', "
                             f"{block_size})")
        self.tree = tree_key(block_size) if tree else None
        missing = [k for k in widths + ([self.tree] if tree else []) if k not in costs.widths]
        if missing:
            raise ValueError(f"widths {missing} have no entry in the step-cost table (it covers {costs.widths}); "
                             "fix: build StepCostTable with the same widths (and tree_key(B) for the tree)")
        if pinned is not None and pinned not in widths:
            raise ValueError(f"pinned k={pinned} is not one of the widths {widths} that have a verify graph; "
                             f"fix: pin one of {widths} or add {pinned} to the widths")
        if stats is None:
            stats = AcceptanceStats(block_size)
        if stats.block_size != block_size:
            raise ValueError(f"stats.block_size={stats.block_size} != block_size={block_size}")
        if not 1 <= probe_every <= probe_max_every:
            raise ValueError(f"probe_every={probe_every}, probe_max_every={probe_max_every}: need "
                             "1 <= probe_every <= probe_max_every")
        self.block_size, self.widths, self.costs, self.stats = block_size, widths, costs, stats
        self.tree_stats = (tree_stats or TreeStats()) if tree else None
        self.pinned, self.adaptive = pinned, adaptive
        if not 0 < probe_budget < 1:
            raise ValueError(f"probe_budget={probe_budget}: the fraction of step time probes may add must lie "
                             "in (0, 1)")
        self.probe_every, self.probe_max_every, self.probe_budget = probe_every, probe_max_every, probe_budget
        self.top = widths[-1]
        self.probe_interval = probe_every  # the doubling state
        self._interval_now = probe_every  # what the last decision used: the doubling state capped by cost
        self.probes = 0
        self._since_probe = 0
        # decisions the in-flight probes are judged against, oldest first (feedback may lag; bounded in case a
        # probe's feedback never arrives)
        self._pending: deque[int] = deque(maxlen=4)
        # the tree probes' own state, same rules
        self.tree_probe_interval = self._tree_interval_now = probe_every
        self.tree_probes = 0
        self._since_tree_probe = 0
        self._tree_pending: deque[int] = deque(maxlen=4)
        self._tree_ok = False  # whether the latest batch could take a tree (a probe's feedback is judged with it)
        keys = widths + ([self.tree] if tree else [])
        self._hist = {k: 0 for k in keys}
        self._commit_sum = {k: 0 for k in keys}
        self._commit_rows = {k: 0 for k in keys}

    def name(self, k: int) -> str:
        """How logs and traces show a shape: the tree as "tree", a chain width as its k."""
        return "tree" if k == self.tree else str(k)

    def timed(self) -> list[int]:
        """The chain widths with a step time (at some batch size): the ones a decision compares."""
        return [k for k in self.widths if self.costs.has(k)]

    def tree_expected(self) -> float:
        """E[commit | tree step], smoothed; an unobserved tree is priced like the full chain."""
        return self.tree_stats.expected_commit(float(self.stats.expected_commit()[self.top]))

    def tree_could_pay(self) -> bool:
        """Some evidence says a tree commits more than one token per step: its own rows, or the chain's full
        width (a drafter that got better shows in the chain's probes first; a tree then gets probed again)."""
        chain = float(self.stats.evidence_commit()[self.top])
        return max(self.tree_stats.evidence_commit(chain), chain) > 1.0 + USELESS_GAIN

    def expected(self, k: int) -> float:
        """E[commit | shape k] (the tree's or a chain width's)."""
        return self.tree_expected() if k == self.tree else float(self.stats.expected_commit()[k])

    def decision(self, bs: int, tree_ok: bool = False) -> int:
        """The throughput-optimal shape for batch size bs under the current statistics (no probing, no controls),
        among the widths that have a step time, and the tree where tree_ok and it has one. A width may have none
        for good: the controller does not time a width the acceptance already rules out (and times it once the
        acceptance says it could pay)."""
        costs = {k: self.costs.cost(bs, k) for k in self.timed()}
        if tree_ok and self.tree is not None and self.costs.has(self.tree):
            costs[self.tree] = self.costs.cost(bs, self.tree)
            return best_shape(self.stats.expected_commit(), costs, self.tree_expected())
        return best_width(self.stats.expected_commit(), costs)

    def choose(self, bs: int, tree_ok: bool = False) -> int:
        """The shape of the next step: k drafts of the chain, or `self.tree`. tree_ok: the batch may take a tree
        step (ignored without tree=True)."""
        tree_ok = self._tree_ok = tree_ok and self.tree is not None
        if self.pinned is not None:
            # a pinned drafted width takes the tree where the batch qualifies: SGLANG_DFLASH_TREE's meaning
            # before the policy priced trees, kept for pinned and fixed modes
            k = self.tree if tree_ok and self.pinned > 0 else self.pinned
        elif not self.adaptive:
            k = self.tree if tree_ok else self.top  # always the tree where it applies (benchmarks' ours-tree<N>)
        elif not self.timed():
            k = self.top  # nothing timed yet: the full block, as without the policy
        else:
            k = d = self.decision(bs, tree_ok)
            if d == self.top:  # verifying everything already: nothing to probe; a later drop starts afresh
                self._since_probe = 0
                self.probe_interval = self._interval_now = self.probe_every
            else:
                self._since_probe += 1
                self._interval_now = min(self.probe_interval, self._affordable_interval(bs, d, self.top))
                if self._since_probe >= self._interval_now:
                    self._since_probe = 0
                    self._pending.append(d)
                    self.probes += 1
                    k = self.top
            if (tree_ok and k == d != self.tree and self.costs.has(self.tree) and self.tree_could_pay()):
                self._since_tree_probe += 1
                self._tree_interval_now = min(self.tree_probe_interval, self._affordable_interval(bs, d, self.tree))
                if self._since_tree_probe >= self._tree_interval_now:
                    self._since_tree_probe = 0
                    self._tree_pending.append(d)
                    self.tree_probes += 1
                    k = self.tree
        self.count(k)
        return k

    def count(self, k: int) -> None:
        """A step of shape k was chosen: the histogram (the controller counts its exploration steps here too)."""
        self._hist[k] += 1

    def _affordable_interval(self, bs: int, k: int, probe: int) -> int:
        """The shortest probe interval whose probes add at most probe_budget to the step time of a run of shape k.
        A chain probe amid chain steps is priced by its extra time (the tokens it commits are not counted: the rule
        from before trees); a probe that involves the tree by its time less the time its expected tokens take at
        k's rate (a tree commits more per step; a chain-top probe amid tree steps commits less)."""
        if not self.costs.has(probe):  # a probe's cost is unknown (probes are not timed: they follow another width)
            return self.tree_probe_interval if probe == self.tree else self.probe_interval
        base, cost = self.costs.cost(bs, k), self.costs.cost(bs, probe)
        if self.tree in (k, probe):
            extra = cost - self.expected(probe) * base / self.expected(k)
        else:
            extra = cost - base
        return max(self.probe_every, math.ceil(extra / (self.probe_budget * base)))

    def record(self, bs: int, k: int, commit_lens, seconds: float | None) -> None:
        """Feed back a finished step: its batch size, its shape k (a width or the tree), the rows' commit lengths,
        its wall time (None if not timed). May lag the step by a step or two."""
        if k not in self._hist:
            raise ValueError(f"record(k={k}): not one of the shapes {list(self._hist)} this policy chooses from; "
                             "fix: record the k that choose() returned for the step")
        c = np.asarray(commit_lens, dtype=np.int64).reshape(-1)
        if k == self.tree:
            self.tree_stats.update(c)
            self.stats.update(np.ones(c.size, dtype=np.int64), 0)  # no chain position observed: they age
        else:
            self.stats.update(c, k)
            if self.tree_stats is not None:
                self.tree_stats.skip()
        if seconds is not None:
            self.costs.observe(bs, k, seconds)
        self._commit_sum[k] += int(c.sum())
        self._commit_rows[k] += int(c.size)
        if k == self.top and self._pending:  # a probe's feedback (or a full step's, when the decision rose meanwhile)
            before = self._pending.popleft()
            if not self.timed() or self.decision(bs, self._tree_ok) > before:
                self.probe_interval = self.probe_every
            else:
                self.probe_interval = min(2 * self.probe_interval, self.probe_max_every)
        if k == self.tree and self._tree_pending:  # a tree probe's feedback: did it make the tree the decision?
            self._tree_pending.popleft()
            if self.decision(bs, True) == self.tree:
                self.tree_probe_interval = self.probe_every
            else:
                self.tree_probe_interval = min(2 * self.tree_probe_interval, self.probe_max_every)

    def histogram(self) -> dict[int, int]:
        """Chosen-shape counts since start (probes included; the tree under key `self.tree`)."""
        return dict(self._hist)

    def summary(self) -> str:
        """One log line: shape histogram (the tree as "tree"), mean commit per shape, a_1..a_4, the expected commit
        of each width, probe intervals."""
        hist = " ".join(f"{self.name(k)}:{n}" for k, n in self._hist.items())
        commit = " ".join(f"{self.name(k)}:{self._commit_sum[k] / self._commit_rows[k]:.2f}"
                          for k in self._hist if self._commit_rows[k])
        a = " ".join(f"{x:.2f}" for x in self.stats.acceptance()[:4])
        # what each width is expected to commit, as the decision reads it (the per-width means above are what
        # the chosen steps did commit; a gap between the two is what to look at when the policy picks badly)
        expected = " ".join(f"{self.name(k)}:{self.expected(k):.2f}" for k in self.widths)
        mode = (f"pinned k={self.pinned}" if self.pinned is not None else "adaptive" if self.adaptive
                else "adaptive off")
        tree = (f" | tree: E[commit] {self.tree_expected():.2f}, probes {self.tree_probes}, interval "
                f"{self._tree_interval_now} steps" if self.tree is not None else "")
        return (f"dflash width ({mode}): k histogram {{{hist}}} | mean commit per k {{{commit or '-'}}} | "
                f"a_1..a_4 {a} | E[commit] {{{expected}}} | probes {self.probes}, interval {self._interval_now} steps{tree} | "
                f"rows seen {self.stats.rows_seen}")
