"""How many drafts the next step verifies: the operator's controls, the adaptive policy, and its feedback.

The decision itself is the pure policy in ``sglang_dflash.adaptive`` (expected committed tokens per second from
running per-position acceptance and a step-time table). This module feeds it without any host synchronisation:

- acceptance arrives through SGLang's ``on_verify_complete_cpu`` hook, which the scheduler calls with each decode
  step's per-request accepted-draft counts once its results are on the host anyway (one or two steps later under
  overlap); steps are matched to it in launch order (a FIFO of what each step verified);
- step time is the step's cycle on the host: from its start to the next decode step's start, read with
  ``time.perf_counter`` (no GPU event, no sync). The scheduler loop is periodic, so the cycle is what one step
  costs whichever side bounds it: on a host-bound target (SmolLM2-135M: a plain step is ~1.5 ms of Python and
  launches, a few hundred microseconds of GPU work) it is the scheduler's and the worker's host time, which GPU
  events around the forward leave out (with them the policy kept speculating where plain decoding was faster:
  benchmarks/results/smollm2-135m-h100-c1-c8); on a GPU-bound one the host waits for the GPU every iteration, so
  it is the GPU time. A cycle is kept only where it belongs to one width: the step before it had the same k and
  batch-size bucket (under overlap the host waits on the previous step's GPU work inside this cycle), and no
  other forward (prefill, idle) ran inside it. Probes and the first step after a switch are therefore not timed;
  a cycle over 4x the table's value (a GC pause, a stall) is clipped;
- the step-time table starts empty: the first steps at each batch-size bucket try every width a few times
  (exploration: the first timed try of each is warm-up, the table gets the median of the others), then it follows
  an EMA of what steps cost; an entry not timed for a while is timed again (a width the table prices wrongly is
  never chosen, so it would never be corrected otherwise). A width the current estimates already rule out is not
  explored at a new bucket (`_worth_timing`): with a useless drafter, timing k = 15 at batch 128 costs ~5 plain
  steps per try, which a short run never earns back. Once the acceptance says the drafter is useful, a bucket times
  the full block first, and a shape that cannot beat a rate measured at the bucket even at a lower bound of its step
  time (its own or a narrower width's time at this bucket or a smaller one) is not timed (`_cannot_win`): at c = 8
  with an accurate drafter start-up exploration had cost 0.945x the pinned full block (issue #45,
  benchmarks/results/oracle-c8-trace-h200), mostly k = 0 steps at every bucket. Every shape is re-asked at every
  step, so one skipped while it could not win is timed once the acceptance says it could.

Trees (SGLANG_DFLASH_TREE=N, issue #38 item 4): the draft tree is one more shape (key B, "tree" in the log, the
trace and the metric) for batches that qualify (``choose(bs, tree_ok)``, the worker asks ``tree_step.applies``).
It is explored, timed, clipped and refreshed exactly like a width, per bucket, but only at steps whose batch could
take it; its commit is learned from tree steps alone (adaptive.TreeStats); it is not timed where the evidence says
no drafted shape can pay (``_could_pay``). With a fixed table the first EXPLORE_STEPS qualifying steps run the
tree, since only tree steps tell its commit. Fixed modes (k pinned > 0, adaptivity off, the k schedule) run the tree
on every drafted step of a qualifying batch, as before the tree was priced.

Tensor parallelism: every rank runs this controller on the same steps, batch sizes and acceptance (the scheduler
feeds each rank the same results), but on its own clock, and ranks that chose different widths would run different
collectives and hang. So the decision reads only values every rank holds identically: the acceptance, the step
count, which steps were timed (decided by the steps' order, never by a clock reading) and a step-time table that
changes only at agreed steps, where rank 0's measured table is broadcast to the others (`TableShare`: one small CPU
broadcast every SHARE_FIRST steps at first, then every SHARE_EVERY). Each rank's own timings stay in its local
table, which only rank 0's broadcast turns into decisions.

Operator controls (environment, read once at startup):
  SGLANG_DFLASH_K=k           pin the verify width to k drafts (0 = plain decode steps that keep the drafter's
                              context current); benchmarks use it to measure each width
  SGLANG_DFLASH_ADAPTIVE=0    no adaptivity: always the full block (SGLang's fixed behaviour)
  SGLANG_DFLASH_WIDTHS=0,3,7,15  the k values that get CUDA graphs and that the policy may choose (default:
                              0, 3, 7 and B-1, those below B-1 only if they fit)
  SGLANG_DFLASH_K_SCHEDULE=15,0,3  tests: cycle through these k values step after step (forces switches)
  SGLANG_DFLASH_LOG_EVERY_S=30  period of the policy's summary line in the server log
  SGLANG_DFLASH_TREE=N        the draft tree as one more shape (above); SGLANG_DFLASH_STEP_COSTS' "tree" entry
  SGLANG_DFLASH_STEP_TRACE=FILE  diagnostics: one JSON line per decode step (k, "tree" for a tree step, batch size,
                              its cycle, the time it was charged, the worker's own host time, its commit lengths),
                              for benchmarks/step_trace.py; "{pid}" in FILE becomes the scheduler's process id
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

from .. import settings
from ..adaptive import USELESS_GAIN, AcceptanceStats, StepCostTable, WidthPolicy, parse_widths, tree_key

logger = logging.getLogger("sglang_dflash")

ENV_PIN, ENV_ADAPTIVE, ENV_WIDTHS = settings.K, settings.ADAPTIVE, settings.WIDTHS
ENV_SCHEDULE, ENV_LOG_EVERY, ENV_TRACE = settings.K_SCHEDULE, settings.LOG_EVERY_S, settings.STEP_TRACE
ENV_STEP_COSTS = settings.STEP_COSTS
# Timed tries of each width per batch-size bucket before the table is trusted: the first is warm-up, the table gets
# the median of the others. The median because the first steps after a server starts or a width first runs at a
# batch size can take many times their cost (first graph launches, lazy allocations): on an H100 an EMA seeded by
# such a cycle put k = 0 at 75 ms against a 1.7 ms plain step, and k = 0 was never chosen again.
EXPLORE_STEPS = 4
# A width not timed at a bucket for this many steps is timed again (a short exploration run), so a table entry
# that went wrong cannot keep its width unchosen for good; the first retime comes early (start-up is when entries
# go wrong: twice on an H100 the first k = 0 tries after start took tens of ms), then the interval doubles.
# Widths the acceptance rules out are not retimed.
REFRESH_FIRST, REFRESH_STEPS = 256, 2048
# Exploration at a new bucket skips width k when its estimated rate (expected commit over the cost interpolated
# from other buckets) is below this fraction of k = 0's. The cost of a wide step relative to a plain one grows with
# the batch (the verify turns compute-bound), so the estimate from smaller buckets is optimistic for k > 0 and a
# 10% margin covers timing noise.
EXPLORE_MARGIN = 0.9
# The acceptance seen says the drafter is useful when the full block is expected to commit at least this many tokens
# per step: then a bucket times the full block first (`_explore_order`). A full-block step costs 1.1-1.6 plain steps
# at the small batches where start-up exploration happens (benchmarks/results/oracle-c8-trace-h200: 1.42 at batch 8),
# so at 2 tokens it is the likely winner; below, k = 0 first as before (a weak drafter loses little either way: the
# order only decides which widths can be skipped, every width that could win is still timed).
USEFUL_COMMIT = 2.0
OUTLIER = 4.0  # a cycle longer than this times the table's value is clipped to it (GC pause, a stall)
TRACE_FLUSH_S = 1.0  # the step trace reaches its file at least this often (diagnostics only)
# Tensor parallelism: the decision table is rank 0's table, shared at these step counts (a share every 16 steps while
# exploration fills the table, every 128 after): a gloo broadcast of a few hundred bytes, ~0.1 ms, i.e. well under
# 1% of the steps in between.
SHARE_FIRST, SHARE_FIRST_UNTIL, SHARE_EVERY = 16, 512, 128


def default_widths(block: int) -> list[int]:
    return sorted({k for k in (0, 3, 7) if k < block - 1} | {block - 1})


def size_bucket(bs: int) -> int:
    return 1 << max(bs - 1, 0).bit_length()  # 1, 2, 4, 8, ...: steps of similar batch size share exploration


@dataclass(frozen=True)
class WidthControls:
    ks: list[int]
    pinned: int | None
    adaptive: bool
    schedule: list[int] | None
    log_every_s: float
    trace_path: str | None = None
    step_costs: dict[int, dict[int, float]] | None = None  # a fixed table (benchmarks): no exploration, no timing
    tree: int = 0  # SGLANG_DFLASH_TREE: nodes of the draft tree, one more shape (key tree_key(B)); 0 = chains only

    @classmethod
    def from_env(cls, block: int, env=None) -> "WidthControls":
        s = settings.Settings.from_env(env)
        adaptive = s.adaptive
        ks = parse_widths(s.widths, block, ENV_WIDTHS) if s.widths else default_widths(block)
        pinned = schedule = None
        if s.k_schedule:
            schedule = [_k_value(ENV_SCHEDULE, k, block) for k in s.k_schedule]
            ks = sorted(set(schedule) | {block - 1})
        elif s.k is not None:
            pinned = _k_value(ENV_PIN, s.k, block)
            ks = sorted({pinned, block - 1})  # only the widths that run get graphs (B-1: SGLang's own)
        elif not adaptive:
            ks = [block - 1]
        tree = settings.tree_size(block, env)
        costs = load_step_costs(s.step_costs, ks, tree_key(block) if tree else None) if s.step_costs and adaptive \
            else None
        return cls(ks=ks, pinned=pinned, adaptive=adaptive, schedule=schedule,
                   log_every_s=s.log_every_s, trace_path=s.step_trace, step_costs=costs, tree=tree)

    def shapes(self, block: int) -> list[int]:
        """The keys the step-cost table and the histograms hold: the chain widths, and the tree's (B) if on."""
        return self.ks + ([tree_key(block)] if self.tree else [])

    def describe(self) -> str:
        tree = f", a tree of {self.tree} nodes for k > 0 where the batch qualifies" if self.tree else ""
        if self.schedule:
            return f"k schedule {self.schedule} (test hook{tree})"
        if self.pinned is not None:
            return f"k pinned to {self.pinned}" + tree
        if not self.adaptive:
            return f"fixed k = {max(self.ks)}" + tree
        return (f"adaptive over k in {self.ks}" + (f" and a tree of {self.tree} nodes" if self.tree else "")
                + (" (fixed step-time table)" if self.step_costs else ""))


def load_step_costs(path: str, ks: list[int], tree: int | None = None) -> dict[int, dict[int, float]]:
    """A fixed step-time table from JSON {k: {batch size: seconds}} (keys may be strings), covering every width in
    ks: with it the policy explores nothing and times nothing, so the same acceptance gives the same choices run
    after run (and on every tensor-parallel rank). Write one from a measured run's trace (benchmarks/step_trace.py).
    tree: the tree's key (tree_key(B)) when trees are on: the entry "tree" is the tree step's time; without one the
    tree is never chosen (it is not timed either: the table is fixed)."""
    import json

    name = settings.STEP_COSTS

    def key(k) -> int:
        if k == "tree":
            if tree is None:
                raise ValueError("a 'tree' entry without SGLANG_DFLASH_TREE: set it, or drop the entry")
            return tree
        return int(k)

    try:
        raw = json.loads(open(path).read())
        table = {key(k): {int(bs): float(t) for bs, t in per_bs.items()} for k, per_bs in raw.items()}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"{name}={path!r}: not a readable JSON table {{k: {{batch size: seconds}}}} ({e}). "
                         "Fix: write one as benchmarks/README.md shows, or unset the variable") from None
    missing = [k for k in ks if not table.get(k)]
    bad = [(k, bs, t) for k, per_bs in table.items() for bs, t in per_bs.items() if not (t > 0 and bs >= 1)]
    if missing or bad:
        raise ValueError(f"{name}={path!r}: " + (f"no step time for widths {missing} (the policy chooses among "
                         f"{ks})" if missing else f"entries {bad[:3]} are not a batch size >= 1 with seconds > 0")
                         + ". Fix: give every width at least one batch size with its seconds per step")
    return table


def _k_value(name: str, k: int, block: int) -> int:
    if not 0 <= k <= block - 1:
        raise ValueError(f"{name}={k}: the drafter's block is {block}, so k must lie in 0..{block - 1}")
    return k


@dataclass
class _Step:
    """One launched decode step until both halves of its feedback are in: its time and its acceptance."""

    bs: int
    k: int
    started: float
    follows: tuple[int, int] | None  # (k, bucket) of the decode step just before it, None if another forward ran
    cycle: float | None = None  # from its start to the next decode step's start; None if a prefill ran inside
    host: float | None = None  # the worker's own host time (step_begin to step_end), for the trace
    timed: bool = False  # its cycle belongs to its width (decided by the steps' order alone, the same on every rank)
    seconds: float | None = None  # its cost, when timed and the clock reading makes sense
    closed: bool = False  # seconds are settled (possibly None)
    accepted: list[int] | None = field(default=None, repr=False)  # accepted drafts per row, from the scheduler

    @property
    def key(self) -> tuple[int, int]:
        return self.k, size_bucket(self.bs)


class WidthController:
    """Chooses k per step and learns from finished steps; one per worker (one scheduler process)."""

    def __init__(self, controls: WidthControls, block: int, enable_metrics: bool = False,
                 share: "TableShare | None" = None):
        self.controls, self.block = controls, block
        self.shapes = controls.shapes(block)  # the chain widths, then the tree's key if trees are on
        self.tree = tree_key(block) if controls.tree else None
        self.policy = WidthPolicy(block, controls.ks, StepCostTable(self.shapes), AcceptanceStats(block),
                                  pinned=controls.pinned, adaptive=controls.adaptive, tree=bool(controls.tree))
        # this rank's measurements; the decisions read self.policy.costs, which is this same table on one GPU and
        # the table shared from rank 0 under tensor parallelism (module docstring)
        self.local_costs = self.policy.costs if share is None else StepCostTable(self.shapes)
        self._share = share
        self._frozen = controls.step_costs is not None  # a fixed table: no exploration, no timing, no share
        if self._frozen:
            for k, per_bs in controls.step_costs.items():
                if k in self.shapes:
                    for bs, seconds in per_bs.items():
                        self.policy.costs.set(bs, k, seconds)
            self._share = None
        self._explored: collections.Counter = collections.Counter()  # (bucket, k) -> timed steps
        self._tree_tries = 0  # tree steps run to learn its commit under a fixed table
        self._samples: dict = collections.defaultdict(list)  # (bucket, k) -> exploration times (for the median)
        self._last_timed: dict = {}  # (bucket, k) -> step count when it was last timed
        self._refresh_after: dict = {}  # (bucket, k) -> steps without a timing before it is retimed
        self._refreshing: set = set()  # (bucket, k) being retimed: explored whatever the table says of them
        self._pending: collections.deque = collections.deque()  # launched steps awaiting their acceptance
        self._open: _Step | None = None  # the latest launched step: its cycle is still running
        self._held: _Step | None = None  # a step between two of another width: its time needs the next cycle
        self._interrupted = False  # a non-decode forward ran since the open step started
        self._clock = time.perf_counter
        self._steps = 0
        self._last_log = time.monotonic()
        self._metric = _width_counter() if enable_metrics else None
        self._trace = (open(controls.trace_path.replace("{pid}", str(os.getpid())), "a", buffering=1 << 16)
                       if controls.trace_path else None)
        self._trace_flushed = time.monotonic()
        if self._trace is not None:
            self._trace.write(json.dumps({"controls": controls.describe(), "block": block}) + "\n")

    # ---------------------------------------------------------------------------------------------- choose
    def choose(self, bs: int, tree_ok: bool = False) -> int:
        """The next step's shape: k drafts of the chain, or `self.tree` (only where tree_ok: trees are on and the
        batch qualifies, tree_step.applies)."""
        c = self.controls
        tree_ok = tree_ok and self.tree is not None
        if c.schedule:
            k = c.schedule[self._steps % len(c.schedule)]
            return self.tree if tree_ok and k > 0 else k  # the test hook's drafted steps take the tree
        if c.pinned is not None or not c.adaptive or len(self.shapes) == 1:
            return self.policy.choose(bs, tree_ok)
        if self._frozen:
            if tree_ok and self._tree_tries < EXPLORE_STEPS and self.policy.costs.has(self.tree) \
                    and self._could_pay(self.tree):
                # a fixed table prices the tree, but only tree steps tell its commit (its prior is the chain's):
                # a few tree steps first, as exploration gives them without a fixed table
                self._tree_tries += 1
                self.policy.count(self.tree)
                return self.tree
            return self.policy.choose(bs, tree_ok)
        if self._share is not None and _share_due(self._steps):
            self.policy.costs = self._share(self.local_costs)
        bucket = size_bucket(bs)
        shapes = self.shapes if tree_ok else c.ks  # a batch that cannot take a tree never times one
        for k in self._explore_order(shapes):  # explore: time every shape that could win here before trusting the table
            if self._explored[bucket, k] < EXPLORE_STEPS and ((bucket, k) in self._refreshing
                                                              or self._worth_timing(bs, k, tree_ok)):
                self.policy.count(k)  # the summary's histogram counts every chosen step
                return k
        for k in shapes:  # refresh: retime a shape whose entry at this bucket is old (it may be what keeps it unchosen)
            last = self._last_timed.get((bucket, k))
            after = self._refresh_after.get((bucket, k), REFRESH_FIRST)
            stale = last is not None and self._steps - last > after
            if stale and self._could_pay(k):
                self._refresh_after[bucket, k] = min(2 * after, REFRESH_STEPS)
                self._explored[bucket, k] = 1  # a new median from the next tries (the warm-up is not repeated)
                self._samples[bucket, k].clear()
                self._refreshing.add((bucket, k))
                self.policy.count(k)
                return k
        return self.policy.choose(bs, tree_ok)

    def _explore_order(self, shapes: list[int]) -> list[int]:
        """The order in which a bucket's shapes are timed. Once the acceptance seen says the drafter is useful, the
        full block first: it is the likely winner, and its measured rate is what lets `_cannot_win` skip narrower
        widths (k = 0 included) without timing them; the others then go narrowest first, so each one measured
        bounds the step time of the wider ones. Otherwise (nothing seen yet, or a weak drafter) k = 0 first, the
        reference, and wide widths only while the evidence says they could pay."""
        top = self.controls.ks[-1]
        stats = self.policy.stats
        if stats.has_evidence() and stats.evidence_commit()[top] >= USEFUL_COMMIT:
            return [top] + [k for k in shapes if k != top]
        return shapes

    def _worth_timing(self, bs: int, k: int, tree_ok: bool = False) -> bool:
        """Whether exploring shape k at this batch size could change a decision. A wider step never costs less than
        a plain one, so E[commit | k] ~ 1 can never pay; once the table has k and 0 at other batch sizes, an
        interpolated rate far below k = 0's is not worth several expensive tries (a probe still revisits it if the
        drafter improves); and a shape whose best possible rate here is below one measured here cannot win
        (`_cannot_win`). Re-asked at every step, so a shape skipped now is timed as soon as the acceptance says it
        could win (the same path for all three reasons). tree_ok: the tree's rate counts as a rival."""
        if k != 0:
            if not self._could_pay(k):
                return False
            policy, costs = self.policy, self.policy.costs
            if costs.has(k) and costs.has(0) and (policy.expected(k) / costs.cost(bs, k)
                                                  < EXPLORE_MARGIN * policy.expected(0) / costs.cost(bs, 0)):
                return False
        return not self._cannot_win(bs, k, tree_ok)

    def _cannot_win(self, bs: int, k: int, tree_ok: bool) -> bool:
        """Shape k cannot beat a shape already measured at this bucket even at its cheapest possible step time:
        E[commit | k] / (a lower bound of its step time) is below EXPLORE_MARGIN times the best measured rate.

        Only bounds that hold are used (`_time_floor`), never another bucket's time as an estimate: a wide step's cost
        grows with the batch, so the width that could be best is timed at every bucket; this only skips shapes that
        lose even if they cost no more than the floor. Where there is no floor (nothing narrower measured yet) k is
        timed. Reads only the decision table, the acceptance and the batch size, so every tensor-parallel rank agrees
        (module docstring). The commit is the smoothed estimate the decision itself uses; the margin covers timing
        noise in the floor and the rival's median."""
        floor = self._time_floor(bs, k)
        if floor is None:
            return False
        policy, costs, bucket = self.policy, self.policy.costs, size_bucket(bs)
        rivals = [i for i in (self.shapes if tree_ok else self.controls.ks)
                  if i != k and any(size_bucket(b) == bucket for b, _ in costs.points(i))]
        best = max((policy.expected(i) / costs.cost(bs, i) for i in rivals), default=None)
        return best is not None and policy.expected(k) / floor < EXPLORE_MARGIN * best

    def _time_floor(self, bs: int, k: int) -> float | None:
        """A lower bound on a step of shape k at this bucket, from the decision table, or None. Two rules hold: a
        shape's step does not get cheaper as the batch grows, and a chain step that verifies more drafts does all
        the work of one that verifies fewer (adaptive.best_width's running maximum). So every point of k or of a
        narrower chain width at this bucket or a smaller one bounds it from below (the batch sizes of a bucket share
        its exploration, as everywhere here). The tree's floor: its own points and k = 0's (a small tree may cost
        less than a long chain)."""
        costs, bucket = self.policy.costs, size_bucket(bs)
        below = [0, k] if k == self.tree else [i for i in self.controls.ks if i <= k]
        return max((s for i in below for b, s in costs.points(i) if size_bucket(b) <= bucket), default=None)

    def _could_pay(self, k: int) -> bool:
        """k = 0 is the reference; a wider step never costs less than a plain one, so it can pay only if it commits
        more than one token per step on average, by the rows seen (AcceptanceStats.evidence_commit: the prior's
        pseudo-row alone reads ~1.1 for a drafter that never had a draft accepted). The tree: WidthPolicy's
        tree_could_pay (its own rows, or the chain's full width)."""
        if k == self.tree:
            return self.policy.tree_could_pay()
        return k == 0 or self.policy.stats.evidence_commit()[k] > 1.0 + USELESS_GAIN

    # ------------------------------------------------------------------------------------- step feedback
    def step_begin(self, bs: int, k: int) -> None:
        """A decode step with k drafts at batch size bs starts now; the one before it ends here (its cycle)."""
        now = self._clock()
        prev = self._open
        if prev is not None:
            prev.cycle = None if self._interrupted else now - prev.started
            self._settle(prev)
        follows = None if prev is None or self._interrupted else prev.key
        self._interrupted = False
        self._open = _Step(bs, k, now, follows)
        self._pending.append(self._open)
        self._steps += 1
        if self._metric is not None:
            self._metric.labels(k=self.policy.name(k)).inc()

    def step_end(self) -> None:
        """The worker has launched the open step's work (diagnostics only: the trace's host time)."""
        if self._trace is not None and self._open is not None:
            self._open.host = self._clock() - self._open.started

    def _settle(self, step: _Step) -> None:
        """step's cycle just ended: decide what it cost, if its width can be told from its neighbours'.

        - After a step of the same width: its cycle (under overlap the host waits on the previous step's GPU work
          inside it, so both must be this width's).
        - Between two steps of one other width w (a probe amid plain steps): the two cycles from its start hold its
          work and one w step's, on either report order, so it cost their sum minus w's table time.
        - Otherwise (a switch, or a prefill inside): not timed."""
        held, self._held = self._held, None
        if held is not None:
            costs = self.local_costs
            if (step.cycle is not None and held.cycle is not None and step.follows == held.key
                    and held.follows == step.key):
                held.timed = True
                seconds = held.cycle + step.cycle - costs.cost(step.bs, step.k) if costs.has(step.k) else None
                held.seconds = seconds if seconds is not None and seconds > 0 else None
            self._close(held)
        if step.cycle is not None and step.follows is not None and step.follows != step.key:
            self._held = step  # settled at the next cycle's end
            return
        if step.cycle is not None and step.follows == step.key:
            step.timed, step.seconds = True, step.cycle
        self._close(step)

    def _close(self, step: _Step) -> None:
        step.closed = True
        self._maybe_record(step)

    def interrupt(self) -> None:
        """A forward that is not a decode step (prefill, idle) ran: the open step's cycle is not its own."""
        self._interrupted = True

    def on_verify_complete(self, num_correct_drafts: list[int], batch_size: int) -> None:
        """SGLang's host-side hook: the accepted-draft counts of the oldest unreported decode step."""
        while self._pending:
            step = self._pending.popleft()
            if step.bs == batch_size:
                break
        else:
            return
        step.accepted = list(num_correct_drafts)
        self._maybe_record(step)

    def _maybe_record(self, step: _Step) -> None:
        if step.accepted is None or not step.closed:
            return  # the other half comes later (non-overlap: the acceptance arrives before the cycle ends)
        # The counts below follow step.timed (the steps' order), never the clock, so they agree on every
        # tensor-parallel rank; the seconds only go into this rank's table.
        seconds, bucket, costs = step.seconds, size_bucket(step.bs), self.local_costs
        if self._frozen:
            seconds = None  # the table is fixed: only the acceptance is learned
        elif step.timed:
            key = bucket, step.k
            self._explored[key] += 1
            self._last_timed[key] = self._steps
            n = self._explored[key]
            if n == 1:
                seconds = None  # warm-up: first timed use of a width at this size (allocator, autotuning, lazy init)
            elif n <= EXPLORE_STEPS:  # exploration: the table gets the median of the tries, once they are in
                if seconds is not None:
                    self._samples[key].append(seconds)
                seconds = None
                if n == EXPLORE_STEPS:
                    if self._samples[key]:
                        costs.set(step.bs, step.k, float(statistics.median(self._samples[key])))
                    self._refreshing.discard(key)
            elif seconds is not None and costs.has(step.k):
                seconds = min(seconds, OUTLIER * costs.cost(step.bs, step.k))
        if seconds is not None:  # before the acceptance: a probe's feedback is judged on the updated table (1 GPU)
            costs.observe(step.bs, step.k, seconds)
        self.policy.record(step.bs, step.k, [n + 1 for n in step.accepted], None)
        if self._trace is not None:
            self._write_trace(step, seconds)
        now = time.monotonic()
        if now - self._last_log >= self.controls.log_every_s:
            self._last_log = now
            logger.info("sglang-dflash speculation: %s | %s | %s", self.controls.describe(), self.policy.summary(),
                        self.cost_summary(step.bs))

    def _write_trace(self, step: _Step, charged: float | None) -> None:
        ms = lambda x: None if x is None else round(x * 1e3, 4)  # noqa: E731
        costs = self.policy.costs
        self._trace.write(json.dumps({
            "t": round(step.started, 6), "bs": step.bs, "k": self._trace_k(step.k),
            "follows": step.follows and [self._trace_k(step.follows[0]), step.follows[1]],
            "cycle_ms": ms(step.cycle),
            "timed_ms": ms(step.seconds), "charged_ms": ms(charged), "host_ms": ms(step.host),
            "table_ms": ms(costs.cost(step.bs, step.k)) if costs.has(step.k) else None,
            "commit": sum(step.accepted) / len(step.accepted) + 1 if step.accepted else None}) + "\n")
        now = time.monotonic()
        if now - self._trace_flushed >= TRACE_FLUSH_S:  # a benchmark stops its server with a kill: no clean exit
            # flushes the buffer, and once a log interval lost all but the first 64 KB (results/oracle-long-levels-h200)
            self._trace_flushed = now
            self._trace.flush()

    def _trace_k(self, k: int):
        return "tree" if k == self.tree else k

    def cost_summary(self, bs: int) -> str:
        """The step-time table at one batch size, in ms per shape (what the decision compares)."""
        costs = self.policy.costs
        known = " ".join(f"{self.policy.name(k)}:{costs.cost(bs, k) * 1e3:.2f}" for k in costs.widths
                         if costs.has(k))
        return f"step ms at bs={bs} {{{known or '-'}}}"


def _share_due(steps: int) -> bool:
    """Whether the decision table is shared at this step count (the same answer on every rank)."""
    every = SHARE_FIRST if steps < SHARE_FIRST_UNTIL else SHARE_EVERY
    return steps % every == 0


class TableShare:
    """Tensor parallelism: rank 0's step-time table for every rank, over the TP group's CPU (gloo) group.

    ``broadcast(obj)`` returns rank 0's object on every rank (``torch.distributed.broadcast_object_list`` on that
    group in the server; tests give a stand-in). Every rank must call it at the same step (``_share_due``)."""

    def __init__(self, rank: int, broadcast):
        self.rank, self._broadcast = rank, broadcast
        self.shares = 0

    def __call__(self, local: StepCostTable) -> StepCostTable:
        table = self._broadcast(copy.deepcopy(local) if self.rank == 0 else None)
        self.shares += 1
        return table

    @classmethod
    def for_tp_group(cls) -> "TableShare | None":
        """The share for SGLang's tensor-parallel group, None on one rank."""
        import torch.distributed as dist
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return None

        def broadcast(obj):
            box = [obj]
            dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
            return box[0]

        return cls(group.rank_in_group, broadcast)


def _width_counter():
    """Prometheus counter of decode steps per chosen k (SGLang's /metrics, --enable-metrics)."""
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    return Counter("sglang_dflash_verify_steps", "DFLASH decode steps by number of drafts verified (k)", ["k"])
