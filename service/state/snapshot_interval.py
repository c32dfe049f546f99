"""``checkpoint.snapshot_every``: at which steps the in-memory snapshots are taken; ``auto`` measures, then agrees.

A number N: every N-th optimizer step (0: none). ``auto``, the default, picks N once per start, from what a
snapshot costs this job against what a step takes, so that the snapshots cost at most :data:`BUDGET` (0.5%) of the
step time, with a snapshot every step where that holds (a lost worker then costs 0-1 steps):

1. Steps ``s+1`` to ``s+CLEAN`` of a start at step ``s`` take no snapshot. The step time is the shorter of the
   last two (``s+1`` holds the first forward's set-up, and a step may hold an evaluation). On CUDA the device is
   synchronised at those boundaries (three times a start), so the host's clock sees the device's step. Over the
   same steps the process's CPU time gives the share of the node's CPUs the training keeps busy (:func:`busy_share`).
2. From step ``s+CLEAN`` to ``s+AGREE-1`` a snapshot is due at every step (one in flight at most, as always), and
   the writer measures each one (:meth:`service.state.snapshot.Snapshots.measured`): its time on the training
   thread (its part at the step boundary, and the wait before the next optimizer update for the copy of the
   weights), and the CPU time of its background work (the staging copy, the serialisation, the checksum, the
   write). One snapshot's cost to the steps is the first plus the second in the busy share: on a node whose cores
   all train (CPU training), all of its CPU time comes out of the steps; on a GPU node whose host cores mostly
   idle, little does.
3. At step ``s+AGREE`` every rank proposes the smallest N with cost / N <= 0.5% of the step time (its median cost,
   the first snapshot left out: it allocates the staging buffers) and every rank takes the largest proposal, in
   one all-reduce: each node writes its own snapshot, and the ranks gather their per-rank state at the steps one
   is due, so the interval must be the same everywhere. A rank that writes none proposes 0; when no rank writes
   any, N is 0 and nothing more is gathered for snapshots.

So the steps a crash loses, N at most, take about 200 times one snapshot's cost to the steps. A crash in steps
``s+1`` to ``s+2`` resumes from where this start did; a run shorter than ``AGREE`` steps keeps a snapshot every
step from ``s+CLEAN`` on.

Why 0.5%: the service's whole work at a step boundary is held to 1% of the step (``bench/overhead.py``, issue #26),
and the snapshots take half of it. It is also nearer the best trade for real failure rates: a snapshot that costs
the steps ``c`` seconds, taken at budget ``b``, costs ``b`` of the training time and loses about ``c / 2b`` seconds
of steps per failure, so with one failure every ``T`` seconds of training the best budget is ``sqrt(c / 2T)``:
0.2% for the 101 MB MLP's 0.35 s snapshot and a failure every 10 hours; a 1% budget pays off only with a failure
about every half hour.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

BUDGET = 0.005  # the snapshots' cost per step, as a share of the step time (see the note below)
CLEAN = 3  # steps after the start with no snapshot: the last two are timed
AGREE = 8  # the step after the start at which the interval is agreed (snapshots every step from CLEAN until then)
MOST = 20_000  # the longest interval auto picks (a snapshot that costs 100 steps: every 20,000 at 0.5%)

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
    """One snapshot's cost to the steps: the median of those measured (the first left out when there are more: it
    allocates the staging buffers), each its training thread's time plus its background CPU time in the busy share."""
    measured = costs[1:] if len(costs) > 1 else costs
    return statistics.median(blocked + background * busy for blocked, background in measured)


def propose(costs: Sequence[Cost], step_time: float | None, busy: float = 1.0) -> int:
    """This rank's proposal: 0 without a measured snapshot (it writes none), else :func:`interval_for`."""
    if not costs:
        return 0
    if step_time is None:  # the timed steps were skipped (a loop left its for mid-step): as before auto
        return 1
    return interval_for(typical_cost(costs, busy), step_time)


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
    ``ranks_here`` and ``cpus``: the node's ranks and the CPUs they share (the busy share).
    """

    def __init__(self, every: int | str, start: int, costs: Callable[[], Sequence[Cost]],
                 agree: Callable[[int], int], sync: Callable[[], None] = lambda: None, ranks_here: int = 1,
                 cpus: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:  # fmt: skip
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)  # in use now: auto takes one every step until it agrees
        self.start = start
        self.decided = not self.auto
        self.costs, self.agree, self.sync = costs, agree, sync
        self.ranks_here, self.cpus, self.clock, self.cpu_clock = ranks_here, cpus, clock, cpu_clock
        self.step_time: float | None = None
        self.busy = 1.0
        self.cost: float | None = None  # this rank's typical snapshot cost, once agreed (None: it writes none)
        self._times: dict[int, tuple[float, float]] = {}

    def describe(self) -> str:
        """What the schedule does from the start: the log line a start writes."""
        if not self.auto:
            return f"every {self.every} steps" if self.every else "off"
        return (f"auto: steps {self.start + 2}-{self.start + CLEAN} are timed without snapshots, then one every "
                f"step until step {self.start + AGREE}, where every rank takes the interval that keeps their cost "
                f"at {BUDGET:.1%} of the step time or less")  # fmt: skip

    def due(self, step: int) -> bool:
        """Is a snapshot of ``step`` due? Called at every step boundary on every rank, in step order; under ``auto``
        it times the first steps and agrees on the interval at ``start + AGREE`` (a collective, once)."""
        if not self.decided:
            since = step - self.start
            if since <= CLEAN:
                self.sync()
                self._times[since] = (self.clock(), self.cpu_clock())
                return since == CLEAN  # the first measured snapshot
            if since < AGREE:
                return True
            self._decide(step)
        return bool(self.every) and step % self.every == 0

    def _decide(self, step: int) -> None:
        timed = [(self._times[k][0] - self._times[k - 1][0], self._times[k][1] - self._times[k - 1][1])
                 for k in range(2, CLEAN + 1) if k in self._times and k - 1 in self._times]  # fmt: skip
        if timed:
            self.step_time = min(wall for wall, _ in timed)
            self.busy = busy_share(sum(cpu for _, cpu in timed), sum(wall for wall, _ in timed), self.ranks_here,
                                   self.cpus)  # fmt: skip
        costs = list(self.costs())
        self.cost = typical_cost(costs, self.busy) if costs else None
        proposal = propose(costs, self.step_time, self.busy)
        self.every = self.agree(proposal)
        self.decided = True
        if not self.every:  # no run id (nothing restarts the workers in place), or no room on any node: said before
            log.debug("no in-memory snapshots from step %d: no node keeps any (checkpoint.snapshot_every=auto)", step)
        elif self.cost is None or self.step_time is None:
            log.info("in-memory snapshots every %d steps from step %d (checkpoint.snapshot_every=auto, the nodes' "
                     "choice; this rank writes none)", self.every, step)  # fmt: skip
        else:
            log.info("in-memory snapshots every %d steps from step %d (checkpoint.snapshot_every=auto): one costs "
                     "the steps %.1f ms here (the training keeps %.0f%% of this node's CPUs busy) and a step takes "
                     "%.0f ms; this node asked for every %d, and every rank takes the largest choice: %.2f%% of the "
                     "step time", self.every, step, self.cost * 1e3, self.busy * 100, self.step_time * 1e3, proposal,
                     self.cost / self.every / self.step_time * 100 if self.step_time > 0 else math.inf)  # fmt: skip
