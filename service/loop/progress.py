"""Where this rank's main thread stands: the record the loop marks and the hang watchdog reads.

The loop marks it with plain attribute writes (no lock, no syscall): the
``step`` done, the ``phase`` it is in, and a ``tick`` bumped every micro-step
and every eval batch, so a long evaluation counts as progress.
:meth:`Progress.stepped` also keeps the last optimizer-step times, from which
:func:`hang_timeout` and :func:`teardown_grace` derive their bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

STARTUP = "startup"
DATA = "data"
FORWARD_BACKWARD = "forward_backward"  # DDP's gradient all-reduce runs inside the backward: not told apart
OPTIMIZER = "optimizer"
BOUNDARY = "boundary"  # after a step: the log window's sums and the preemption agreement, both collectives
EVAL = "eval"
CHECKPOINT = "checkpoint"
# The order of the phases at one value of ``step`` (steps done): the boundary, eval and checkpoint after a
# step, then the next step's data, forward/backward and optimizer. Lower is behind.
ORDER = {STARTUP: 0, BOUNDARY: 1, EVAL: 2, CHECKPOINT: 3, DATA: 4, FORWARD_BACKWARD: 5, OPTIMIZER: 6}

WINDOW = 200  # optimizer-step times kept for the p99
AUTO_FACTOR = 10.0
AUTO_FLOOR = 30.0
GRACE_FACTOR = 3.0
GRACE_FLOOR = 2.0
STARTUP_GRACE = 10.0  # after a stop signal, before any step of this start is measured


class Progress:
    """One rank's step, phase and tick; written by the main thread, read by the watchdog's."""

    __slots__ = ("step", "phase", "tick", "_times", "_count")

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.phase = STARTUP
        self.tick = 0
        self._times = [0.0] * WINDOW
        self._count = 0

    def stepped(self, step: int, seconds: float) -> None:
        """Optimizer step ``step`` is done; it took ``seconds`` (host wall time, data wait included)."""
        self._times[self._count % WINDOW] = seconds
        self._count += 1
        self.step = step
        self.phase = BOUNDARY

    def snapshot(self) -> tuple[int, str, int]:
        return self.step, self.phase, self.tick

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
