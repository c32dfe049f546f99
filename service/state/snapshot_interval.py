"""``checkpoint.snapshot_every``: at which steps the in-memory snapshots are taken; ``auto`` measures, agrees, and
keeps measuring.

A number N: every N-th optimizer step (0: none). ``auto``, the default, picks N from what a snapshot costs this job
against what a step takes, and moves it when either changes. In each start at step ``s``:

1. Steps ``s+1`` to ``s+CLEAN-1`` take no snapshot; from ``s+CLEAN`` to ``s+AGREE-1`` a snapshot is due at every
   step (one in flight at most, as always), and the writer measures each one
   (:meth:`service.state.snapshot.Snapshots.measured`): its time on the training thread (its part at the step
   boundary, and the wait before the next optimizer update for the copy of the weights), and the CPU time of its
   background work (the staging copy, the serialisation, the checksum, the write). Every boundary from ``s+1`` to
   ``s+AGREE`` is timed (on CUDA the device is synchronised there, so the host's clock sees the device's step).
2. The steady step: the first step (``s+1``: the first forward's set-up) is never timed; of the others, a step whose
   body did not run (no forward of a wrapped model, or under :data:`NEAR_EMPTY` of the median step) is left out,
   and the shortest of the rest is the step time (a step with an evaluation, or a slow start, sets nothing: so the
   same interval comes with or without a skewed start). The median is the typical step, for the time ceiling. The
   process's CPU time over the timed steps gives the share of the node's CPUs the training keeps busy
   (:func:`busy_share`). One snapshot's cost to the steps is its training-thread time plus its background CPU in
   that share: on a node whose cores all train (CPU training), all of its CPU time comes out of the steps; on a GPU
   node whose host cores mostly idle, little does.
3. At step ``s+AGREE`` every rank proposes an interval (:func:`proposal_for`): every step for a small snapshot
   (:data:`SMALL_SECONDS` or less, and :data:`SMALL_SHARE` of the step or less: a lost worker then costs 0-1 steps,
   the promise of issue #26), else the smallest N with cost / N <= :data:`BUDGET` (0.5%) of the step time; never
   more than ``checkpoint.snapshot_max_seconds`` of typical steps (a failure loses at most that much training) nor
   :data:`MOST`. Every rank takes the largest proposal, in one all-reduce: each node writes its own snapshot, and
   the ranks gather their per-rank state at the steps one is due, so the interval must be the same everywhere. A
   rank that writes none proposes 0; when no rank writes any, N is 0 and nothing more is gathered or timed.
4. Then it keeps measuring: every :func:`check_period` steps (a quarter of the interval, at least
   :data:`CHECK_STEPS`) the last :data:`TIMED` steps are timed again and the recent snapshots' cost read; a rank
   whose step time, typical step or snapshot cost moved by more than :data:`FACTOR` (2x) since its last proposal
   proposes afresh, the others repeat theirs, and every rank takes the largest, in the same all-reduce at the same
   steps on every rank (the check steps follow from the agreed interval alone). A move is logged with its cause.

``summary.json``'s ``snapshots.intervals`` lists the intervals used in this start, ``{from_step, every}`` each.

Why 0.5%: the service's whole work at a step boundary is held to 1% of the step (``bench/overhead.py``, issue #26),
and the snapshots take half of it. It is also nearer the best trade for real failure rates: a snapshot that costs
the steps ``c`` seconds, taken at budget ``b``, costs ``b`` of the training time and loses about ``c / 2b`` seconds
of steps per failure, so with one failure every ``T`` seconds of training the best budget is ``sqrt(c / 2T)``:
0.2% for the 101 MB MLP's 0.35 s snapshot and a failure every 10 hours; a 1% budget pays off only with a failure
about every half hour. A small snapshot (a small model: about 1 ms on the training thread and a few ms of
background CPU) is taken every step anyway, at up to :data:`SMALL_SHARE` of the step: a lost worker then costs at
most one step, whatever the load, as before ``auto``.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from service.config import SNAPSHOT_MAX_SECONDS

log = logging.getLogger(__name__)

BUDGET = 0.005  # the snapshots' cost per step, as a share of the step time (see the note above)
CLEAN = 3  # steps s+1..s+CLEAN-1 of a start at s take no snapshot
AGREE = 8  # the step after the start at which the interval is first agreed (snapshots every step from CLEAN)
MOST = 20_000  # the longest interval auto picks (a snapshot that costs 100 steps: every 20,000 at 0.5%)
SMALL_SECONDS = 0.02  # a snapshot that costs the steps this or less, and at most SMALL_SHARE of a step: every step
SMALL_SHARE = 0.1
FACTOR = 2.0  # a step time or snapshot cost that moves by more than this factor moves the interval
CHECK_STEPS = 64  # re-check at least this many steps apart (one small all-reduce then)
CHECKS = 4  # re-checks per interval, when the interval is longer
TIMED = 4  # the steps timed before each re-check
NEAR_EMPTY = 0.1  # a step shorter than this share of the median timed step did not run its body: left out
RECENT = 5  # the snapshots whose median cost is the cost (the most recent)

Cost = tuple[float, float]  # one snapshot: (seconds on the training thread, CPU seconds in the background)


def interval_for(cost: float, step_time: float, budget: float = BUDGET, most: int = MOST) -> int:
    """The smallest interval N in 1..``most`` with ``cost / N <= budget * step_time`` (``most`` when none is)."""
    allowed = budget * step_time
    if not cost > allowed:  # free, or cheap enough every step (a NaN cost too: nothing to go by)
        return 1
    if not allowed > 0 or not math.isfinite(cost):
        return most
    interval = min(most, max(1, math.ceil(cost / allowed)))
    while interval < most and cost / interval > allowed:  # ceil's float rounding, either way
        interval += 1
    while interval > 1 and cost / (interval - 1) <= allowed:
        interval -= 1
    return interval


def busy_share(cpu_seconds: float, wall_seconds: float, ranks_here: int, cpus: float) -> float:
    """The share of this node's CPUs its training keeps busy, 0 to 1: this process's CPU time over the wall time,
    times the ranks on the node (each does the same work), over the CPUs they may use."""
    if not wall_seconds > 0 or not cpus > 0:
        return 1.0
    return min(1.0, max(0.0, cpu_seconds / wall_seconds * ranks_here / cpus))


def typical_cost(costs: Sequence[Cost], busy: float) -> float:
    """One snapshot's cost to the steps: the median of the :data:`RECENT` most recent measured (the start's first
    left out when there are more: it allocates the staging buffers), each its training thread's time plus its
    background CPU time in the busy share."""
    measured = (costs[1:] if len(costs) > 1 else costs)[-RECENT:]
    return statistics.median(blocked + background * busy for blocked, background in measured)


def small(cost: float, step_time: float) -> bool:
    """A snapshot taken every step whatever the budget: :data:`SMALL_SECONDS` or less, and :data:`SMALL_SHARE` of the
    step or less (a small model's fixed cost)."""
    return cost <= SMALL_SECONDS and cost <= SMALL_SHARE * step_time


def ceiling_steps(max_seconds: float, typical_step: float | None) -> int:
    """The most steps one failure may lose: ``max_seconds`` of typical steps, at least 1, at most :data:`MOST`."""
    if typical_step is None or not typical_step > 0 or not math.isfinite(max_seconds):
        return MOST
    steps = max(1, min(MOST, math.floor(max_seconds / typical_step)))
    while steps > 1 and steps * typical_step > max_seconds:  # the quotient's float rounding (1.9 / 0.005: 380)
        steps -= 1
    return steps


def proposal_for(cost: float, step_time: float, typical_step: float | None = None,
                 max_seconds: float = math.inf) -> int:  # fmt: skip
    """Every step for a :func:`small` snapshot, else :func:`interval_for`; never over :func:`ceiling_steps`."""
    every = 1 if small(cost, step_time) else interval_for(cost, step_time)
    return min(every, ceiling_steps(max_seconds, typical_step))


def propose(costs: Sequence[Cost], step_time: float | None, busy: float = 1.0, typical_step: float | None = None,
            max_seconds: float = math.inf) -> int:  # fmt: skip
    """This rank's proposal: 0 without a measured snapshot (it writes none), else :func:`proposal_for`."""
    if not costs:
        return 0
    if step_time is None:  # the timed steps were skipped (a loop left its for mid-step): as before auto
        return 1
    return proposal_for(typical_cost(costs, busy), step_time, typical_step, max_seconds)


def steady(walls: Sequence[float], ran: Sequence[bool]) -> tuple[float, float] | None:
    """(the step time, the typical step) of timed steps: the steps whose body ran (all, when none is known to have
    run: a loop without a wrapped model) and not under :data:`NEAR_EMPTY` of their median; the shortest of them (a
    slow step among fast ones sets nothing), and their median. None without a timed step."""
    kept = [wall for wall, body in zip(walls, ran, strict=True) if body] or list(walls)
    if not kept:
        return None
    median = statistics.median(kept)
    kept = [wall for wall in kept if wall >= NEAR_EMPTY * median] or kept
    return min(kept), statistics.median(kept)


def check_period(every: int) -> int:
    """Steps from one check of an agreed interval to the next: :data:`CHECKS` a interval, at least
    :data:`CHECK_STEPS` apart. It follows from the agreed interval alone, so every rank checks at the same steps."""
    return max(CHECK_STEPS, math.ceil(every / CHECKS))


def moved(old: float | None, new: float | None) -> bool:
    """Did a measure move by more than :data:`FACTOR`, either way (or appear, or vanish)?"""
    if old is None or new is None:
        return (old is None) != (new is None)
    if not old > 0 or not new > 0:
        return (old > 0) != (new > 0)
    return max(old / new, new / old) > FACTOR


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity, or fewer under a cgroup's CPU quota (a container's limit)."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cpus = float(os.cpu_count() or 1)
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return max(cpus, 1e-3)


class SnapshotSchedule:
    """Whether a snapshot is due at a step, the same answer on every rank.

    ``every``: the config's value (a number, or ``auto``); ``start``: the step this start resumed at (0 afresh);
    ``costs``: this rank's measured snapshots (waits for one in flight; empty on a rank that writes none);
    ``agree``: the largest of the ranks' proposals (a collective); ``sync``: waits for the device (CUDA);
    ``ranks_here`` and ``cpus``: the node's ranks and the CPUs they share (the busy share); ``max_seconds``:
    ``checkpoint.snapshot_max_seconds``; ``ran``: a count that moves when a step's body runs (the forwards);
    ``recent``: the costs measured so far without waiting for a snapshot in flight (the re-checks'; ``costs``).
    """

    def __init__(self, every: int | str, start: int, costs: Callable[[], Sequence[Cost]],
                 agree: Callable[[int], int], sync: Callable[[], None] = lambda: None, ranks_here: int = 1,
                 cpus: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time, max_seconds: float = SNAPSHOT_MAX_SECONDS,
                 ran: Callable[[], int] = lambda: 0,
                 recent: Callable[[], Sequence[Cost]] | None = None) -> None:  # fmt: skip
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)  # in use now: auto takes one every step until it agrees
        self.start = start
        self.decided = not self.auto
        self.costs, self.agree, self.sync, self.ran = costs, agree, sync, ran
        self.recent = recent or costs
        self.ranks_here, self.cpus, self.clock, self.cpu_clock = ranks_here, cpus, clock, cpu_clock
        self.max_seconds = max_seconds
        self.step_time: float | None = None  # the steady step, as last proposed on (the shortest timed)
        self.typical_step: float | None = None  # the median timed step (the time ceiling's)
        self.busy = 1.0
        self.cost: float | None = None  # this rank's typical snapshot cost, as last proposed on (None: writes none)
        self.proposal = 0  # this rank's last proposal
        self.next_check: int | None = None  # the step of the next re-check (auto, agreed, snapshots on)
        # The intervals used in this start, summary.json's snapshots.intervals
        first = start + (CLEAN if self.auto else 1)
        self.intervals: list[dict[str, int]] = [{"from_step": first, "every": self.every}]
        self._marks: dict[int, tuple[float, float, int]] = {}

    def describe(self) -> str:
        """What the schedule does from the start: the log line a start writes."""
        if not self.auto:
            return f"every {self.every} steps" if self.every else "off"
        return (f"auto: steps {self.start + 2}-{self.start + AGREE} are timed, with one every step from step "
                f"{self.start + CLEAN}; at step {self.start + AGREE} every rank takes the interval that keeps their "
                f"cost at {BUDGET:.1%} of the step time or less (every step for a small one: {SMALL_SECONDS * 1e3:.0f} "
                f"ms or less, and {SMALL_SHARE:.0%} of a step or less), a failure losing at most {self.max_seconds:g} "
                f"s of steps (checkpoint.snapshot_max_seconds); re-measured every quarter interval ({CHECK_STEPS} "
                f"steps apart at least), it moves when a step or a snapshot changes by more than "
                f"{FACTOR:g}x")  # fmt: skip

    def due(self, step: int) -> bool:
        """Is a snapshot of ``step`` due? Called at every step boundary on every rank, in step order; under ``auto``
        it times the steps, agrees on the interval at ``start + AGREE`` and re-checks it at the steps
        :func:`check_period` says (a collective each time, on every rank)."""
        if not self.decided:
            since = step - self.start
            self._mark(step)
            if since < AGREE:
                return since >= CLEAN
            self._decide(step)
        elif self.next_check is not None and step >= self.next_check - TIMED:
            self._mark(step)
            if step >= self.next_check:
                self._recheck(step)
        return bool(self.every) and step % self.every == 0

    def _mark(self, step: int) -> None:
        self.sync()
        self._marks[step] = (self.clock(), self.cpu_clock(), self.ran())

    def _measure(self, costs: Callable[[], Sequence[Cost]]) -> tuple[float | None, float | None, float | None,
                                                                     list[Cost]]:  # fmt: skip
        """(step time, typical step, snapshot cost, costs) of the steps timed since the last decision."""
        # To the nanosecond (perf_counter's resolution): float rounding moves no boundary case
        timed = [(round(now[0] - before[0], 9), now[1] - before[1], now[2] != before[2])
                 for step, now in sorted(self._marks.items())
                 if (before := self._marks.get(step - 1)) is not None]  # fmt: skip
        self._marks.clear()
        step_time = typical = None
        if timed and (found := steady([wall for wall, _, _ in timed], [body for _, _, body in timed])):
            step_time, typical = found
            self.busy = busy_share(sum(cpu for _, cpu, _ in timed), sum(wall for wall, _, _ in timed),
                                   self.ranks_here, self.cpus)  # fmt: skip
        measured = list(costs())
        return step_time, typical, typical_cost(measured, self.busy) if measured else None, measured

    def _decide(self, step: int) -> None:
        # The probe's last snapshot is waited for: once a start
        self.step_time, self.typical_step, self.cost, costs = self._measure(self.costs)
        self.proposal = propose(costs, self.step_time, self.busy, self.typical_step, self.max_seconds)
        self.every = self.agree(self.proposal)
        self.decided = True
        self._record(step)
        self.next_check = step + check_period(self.every) if self.every else None
        if not self.every:  # no run id (nothing restarts the workers in place), or no room on any node: said before
            log.debug("no in-memory snapshots from step %d: no node keeps any (checkpoint.snapshot_every=auto)", step)
        elif self.cost is None or self.step_time is None:
            log.info("in-memory snapshots every %d steps from step %d (checkpoint.snapshot_every=auto, the nodes' "
                     "choice; this rank writes none)", self.every, step)  # fmt: skip
        else:
            log.info("in-memory snapshots every %d steps from step %d (checkpoint.snapshot_every=auto): %s; this "
                     "node asked for every %d, and every rank takes the largest choice", self.every, step,
                     self._figures(), self.proposal)  # fmt: skip

    def _recheck(self, step: int) -> None:
        step_time, typical, cost, costs = self._measure(self.recent)  # no wait for a snapshot in flight
        causes = [f"{what} {'none' if old is None else f'{old * 1e3:.1f} ms'} -> {new * 1e3:.1f} ms"
                  for what, old, new in (("a step", self.step_time, step_time), ("a typical step",
                                         self.typical_step, typical), ("a snapshot", self.cost, cost))
                  if new is not None and moved(old, new)] if step_time is not None and costs else []  # fmt: skip
        if causes:  # this rank proposes afresh; the others repeat their last proposal
            self.step_time, self.typical_step, self.cost = step_time, typical, cost
            self.proposal = propose(costs, step_time, self.busy, typical, self.max_seconds)
        before, self.every = self.every, self.agree(self.proposal)
        self.next_check = step + check_period(self.every) if self.every else None
        if self.every == before:
            return
        self._record(step)
        why = (
            f"here {', '.join(causes)}, a change of more than {FACTOR:g}x"
            if causes
            else f"another node's measures moved by more than {FACTOR:g}x"
        )
        log.info("in-memory snapshots every %d steps from step %d, not %d (checkpoint.snapshot_every=auto keeps "
                 "measuring): %s; %s; this node asks for every %d, and every rank takes the largest choice",
                 self.every, step, before, why, self._figures(), self.proposal)  # fmt: skip

    def _record(self, step: int) -> None:
        if self.intervals[-1]["every"] != self.every:
            self.intervals.append({"from_step": step, "every": self.every})

    def _figures(self) -> str:
        if self.cost is None or self.step_time is None:
            return "this rank writes none"
        share = self.cost / self.every / self.step_time * 100 if self.step_time > 0 and self.every else math.inf
        return (f"one costs the steps {self.cost * 1e3:.1f} ms here (the training keeps {self.busy:.0%} of this "
                f"node's CPUs busy) and a step takes {self.step_time * 1e3:.0f} ms ({share:.2f}% of the step time; "
                f"{'a small snapshot: every step, ' if small(self.cost, self.step_time) else ''}at most "
                f"{self.max_seconds:g} s of steps lost, checkpoint.snapshot_max_seconds)")  # fmt: skip
