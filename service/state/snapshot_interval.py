"""``checkpoint.snapshot_every``: at which steps the in-memory snapshots are taken; ``auto`` measures, then agrees.

A number N: every N-th optimizer step (0: none). ``auto``, the default, picks N once per start, from what a
snapshot costs this job against what a step takes, so that the snapshots cost at most :data:`BUDGET` (1%) of the
step time, and a snapshot every step where that holds (small models: a lost worker costs 0-1 steps):

1. Steps ``s+1`` to ``s+CLEAN`` of a start at step ``s`` take no snapshot. The step time is the shorter of the
   last two of them (``s+1`` holds the first forward's set-up, and a step may hold an evaluation). On CUDA the
   device is synchronised at those boundaries (three times a start), so the host's clock sees the device's step.
2. From step ``s+CLEAN`` to ``s+AGREE-1`` a snapshot is due at every step (one in flight at most, as always), and
   the writer records each one's whole cost to the process: its part at the step boundary (the buffers' copy),
   the wait before the next optimizer update for the copy of the weights, and the CPU time of the writer thread
   (the staging copy, the serialisation, the checksum, the write). On a node whose cores all train, that CPU
   time comes out of the steps; on a GPU node it mostly does not, so the measure errs long there.
3. At step ``s+AGREE`` every node proposes the smallest N with cost / N <= 1% of the step time (its median cost,
   the first snapshot left out: it allocates the staging buffers), and every rank takes the largest proposal in
   one all-reduce: each node writes its own snapshot, and the ranks gather their per-rank state at the steps a
   snapshot is due, so the interval is the same everywhere. A rank that writes none proposes 0; when no rank
   writes any, N is 0 and nothing more is gathered for snapshots.

A crash in steps ``s+1`` to ``s+3`` resumes from where this start did; a run shorter than ``AGREE`` steps keeps a
snapshot every step from ``s+CLEAN`` on.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

BUDGET = 0.01  # the snapshots' cost per step, as a share of the step time
CLEAN = 3  # steps after the start with no snapshot: the last two are timed
AGREE = 8  # the step after the start at which the interval is agreed (snapshots every step from CLEAN until then)
MOST = 10_000  # the longest interval auto picks (a snapshot that costs 100 steps: every 10,000 at 1%)


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


def typical_cost(costs: Sequence[float]) -> float:
    """One snapshot's cost: the median of those measured, the first left out when there are more (it allocates)."""
    return statistics.median(costs[1:] if len(costs) > 1 else costs)


def propose(costs: Sequence[float], step_time: float | None) -> int:
    """This rank's proposal: 0 without a measured snapshot (it writes none), else :func:`interval_for`."""
    if not costs:
        return 0
    if step_time is None:  # the timed steps were skipped (a loop left its for mid-step): as before auto
        return 1
    return interval_for(typical_cost(costs), step_time)


class SnapshotSchedule:
    """Whether a snapshot is due at a step, the same answer on every rank.

    ``every``: the config's value (a number, or ``auto``); ``start``: the step this start resumed at (0 afresh);
    ``costs``: this rank's measured snapshot costs in seconds (waits for one in flight; empty on a rank that writes
    none); ``agree``: the largest of the ranks' proposals (a collective); ``sync``: waits for the device (CUDA).
    """

    def __init__(self, every: int | str, start: int, costs: Callable[[], Sequence[float]],
                 agree: Callable[[int], int], sync: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)  # in use now: auto takes one every step until it agrees
        self.start = start
        self.decided = not self.auto
        self.costs, self.agree, self.sync, self.clock = costs, agree, sync, clock
        self.step_time: float | None = None
        self.cost: float | None = None  # this rank's typical snapshot cost, once agreed (None: it writes none)
        self._times: dict[int, float] = {}

    def describe(self) -> str:
        """What the schedule does from the start: the log line a start writes."""
        if not self.auto:
            return f"every {self.every} steps" if self.every else "off"
        first, agreed = self.start + CLEAN, self.start + AGREE
        return (f"auto: steps {self.start + 2}-{first} are timed without snapshots, then one every step until step "
                f"{agreed}, where the interval that keeps their cost at {BUDGET:.0%} of the step time or less is "
                "agreed")  # fmt: skip

    def due(self, step: int) -> bool:
        """Is a snapshot of ``step`` due? Called at every step boundary on every rank, in step order; under ``auto``
        it times the first steps and agrees on the interval at ``start + AGREE`` (a collective, once)."""
        if not self.decided:
            since = step - self.start
            if since <= CLEAN:
                self.sync()
                self._times[since] = self.clock()
                return since == CLEAN  # the first measured snapshot
            if since < AGREE:
                return True
            self._decide(step)
        return bool(self.every) and step % self.every == 0

    def _decide(self, step: int) -> None:
        periods = [self._times[k] - self._times[k - 1] for k in range(2, CLEAN + 1)
                   if k in self._times and k - 1 in self._times]  # fmt: skip
        self.step_time = min(periods) if periods else None
        costs = list(self.costs())
        self.cost = typical_cost(costs) if costs else None
        proposal = propose(costs, self.step_time)
        self.every = self.agree(proposal)
        self.decided = True
        if self.cost is not None and self.step_time is not None:
            share = self.cost / max(self.every, 1) / self.step_time if self.step_time > 0 else math.inf
            log.info("in-memory snapshots every %d steps from step %d (checkpoint.snapshot_every=auto): one costs "
                     "%.0f ms on this node and a step takes %.0f ms, so this node asked for every %d (the largest "
                     "of the nodes' choices is taken): %.2f%% of the step time", self.every, step, self.cost * 1e3,
                     self.step_time * 1e3, proposal, share * 100)  # fmt: skip
        elif self.every:
            log.info("in-memory snapshots every %d steps from step %d (checkpoint.snapshot_every=auto; the nodes' "
                     "choice: this rank writes none)", self.every, step)  # fmt: skip
        else:
            log.info("no in-memory snapshots from step %d: no node keeps any (checkpoint.snapshot_every=auto)", step)
