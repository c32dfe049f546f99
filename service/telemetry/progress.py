"""Where this rank's main thread stands: the record the loop marks and the hang watchdog reads.

The loop marks it with plain attribute writes (no lock, no syscall): the
``step`` done, the ``phase`` it is in, the ``micro``-step of the step it is in, and a ``tick`` bumped every
micro-step and every eval batch, so a long evaluation counts as progress. ``compiling`` counts the
torch.compile compilations under way on this rank (dynamo's start and end callbacks): compiling is progress,
bounded by the start-up bound rather than the hang timeout. :meth:`Progress.stepped` also keeps the last
optimizer-step times, from which :func:`hang_timeout` and :func:`teardown_grace` derive their bounds.

Forward and backward are two phases: a rank whose forward returned (its loss is computed, its backward and
DDP's gradient all-reduce under way) is ahead of one still in its forward, so a rank that loops in its own
forward is named alone while its peers wait for it in the all-reduce. Within a phase, ``entered`` counts the
collectives this rank entered (the CPU SyncBatchNorm's all-reduces call :meth:`Progress.collective`): a rank
waiting in the forward's first SyncBatchNorm all-reduce is ahead of one that never reached it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

STARTUP = "startup"
DATA = "data"
FORWARD = "forward"  # the micro-step's forward and its loss
BACKWARD = "backward"  # its backward, with DDP's gradient all-reduce inside
OPTIMIZER = "optimizer"
BOUNDARY = "boundary"  # after a step: the log window's sums and the preemption agreement, both collectives
EVAL = "eval"
CHECKPOINT = "checkpoint"
# The order of the phases at one value of ``step`` (steps done): the boundary, eval and checkpoint after a
# step, then the next step's data, each micro-step's forward and backward, and the optimizer. Lower is behind.
ORDER = {STARTUP: 0, BOUNDARY: 1, EVAL: 2, CHECKPOINT: 3, DATA: 4, FORWARD: 5, BACKWARD: 6, OPTIMIZER: 7}
MICRO_STAGES = 2  # forward and backward: the stages of one micro-step


def position(step: int, phase: str, micro: int = 0, entered: int = 0) -> tuple[int, int, int]:
    """Where a rank stands, comparable across ranks: (steps done, stage, collectives entered in the stage); the
    micro-steps of a step in order."""
    stage = ORDER[phase]
    if phase in (FORWARD, BACKWARD):
        stage = ORDER[FORWARD] + MICRO_STAGES * micro + (phase == BACKWARD)
    elif phase == OPTIMIZER:
        stage = 1 << 30
    return step, stage, entered


WINDOW = 200  # optimizer-step times kept for the p99
AUTO_FACTOR = 10.0
AUTO_FLOOR = 30.0
GRACE_FACTOR = 3.0
GRACE_FLOOR = 2.0
STARTUP_GRACE = 10.0  # after a stop signal, before any step of this start is measured


class Progress:
    """One rank's step, phase and tick; written by the main thread, read by the watchdog's."""

    __slots__ = ("step", "phase", "tick", "micro", "entered", "compiling", "forwards", "_times", "_count")

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.phase = STARTUP
        self.tick = 0
        self.micro = 0
        self.entered = 0
        self.compiling = 0
        self.forwards = 0  # forwards started in this step (the micro-steps of a task, a script's every model call)
        self._times = [0.0] * WINDOW
        self._count = 0

    def stepped(self, step: int, seconds: float) -> None:
        """Optimizer step ``step`` is done; it took ``seconds`` (host wall time, data wait included)."""
        self._times[self._count % WINDOW] = seconds
        self._count += 1
        self.step = step
        self.phase = BOUNDARY
        self.micro = self.entered = self.forwards = 0

    def mark(self, phase: str, micro: int = 0) -> None:
        """The main thread enters ``phase`` (of micro-step ``micro``); no collective entered in it yet."""
        self.phase, self.micro, self.entered = phase, micro, 0

    def forward_started(self) -> None:
        """A forward of a wrapped model begins (:class:`~service.model.wrapped.ServiceDDP`): its own stage."""
        self.phase, self.micro, self.entered = FORWARD, self.forwards, 0
        self.forwards += 1
        self.tick += 1

    def forward_done(self) -> None:
        """That forward returned: its backward (and the gradient all-reduce in it) comes next."""
        self.phase, self.entered = BACKWARD, 0

    def collective(self) -> None:
        """This rank enters a collective of the current phase (SyncBatchNorm's all-reduce: forward or backward)."""
        self.entered += 1

    def snapshot(self) -> tuple[int, str, int, int, int, int]:
        return self.step, self.phase, self.tick, self.micro, self.entered, self.compiling

    def compile_started(self, *args: object) -> None:
        """dynamo's start-of-compilation callback (any thread)."""
        self.compiling += 1

    def compile_ended(self, *args: object) -> None:
        """dynamo's end-of-compilation callback."""
        self.compiling = max(0, self.compiling - 1)

    def p99(self) -> float | None:
        """The p99 of the recent optimizer-step times; None before this start measured one."""
        count = min(self._count, WINDOW)
        return p99(self._times[:count]) if count else None


def p99(values: Sequence[float]) -> float:
    """The nearest-rank 99th percentile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def hang_timeout(setting: float | str, step_p99: float | None, startup_seconds: float) -> float:
    """Seconds without progress that make a hang.

    ``setting``: ``dist.hang_timeout_seconds`` (``auto`` or seconds); ``step_p99``: :meth:`Progress.p99`;
    ``startup_seconds``: ``dist.timeout_seconds``, the bound until a step is measured (start-up, the first
    step), since nothing tells how long those take.
    """
    if step_p99 is None:
        return float(startup_seconds)
    if setting == "auto":
        return max(AUTO_FACTOR * step_p99, AUTO_FLOOR)
    return float(setting)


def teardown_grace(step_p99: float | None) -> float:
    """After a stop signal, how long a rank may go without progress before it is taken as stuck."""
    if step_p99 is None:
        return STARTUP_GRACE
    return max(GRACE_FACTOR * step_p99, GRACE_FLOOR)
