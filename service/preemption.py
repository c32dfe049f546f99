"""Preemption: SIGTERM or SIGUSR1 sets a flag; at the next optimizer-step boundary every rank learns it.

A signal handler only sets a flag, so no rank dies inside a collective. The
loop asks :meth:`Preemption.stop_now` after each optimizer step; one small
all-reduce (MAX over the ranks' flags) makes a signal that reached one rank,
or one node, stop them all at the same step. Rank 0 then saves, everyone
meets at a barrier, and the workers exit with :data:`EXIT_PREEMPTED`.

Exit codes of a worker (and of ``ddp-service train``):

- ``0``: completed;
- ``75`` (``EX_TEMPFAIL``): preempted; the checkpoint of that step is saved,
  and the same command resumes from it. Non-zero on purpose: the torchrun
  agents of the nodes that were *not* signalled must see their workers stop,
  restart them and re-rendezvous without the node that left;
- ``1``: failed.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 75

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ignore_in_data_workers(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: loader processes ignore the preemption signals.

    torchrun signals its workers' whole process group, so the loader processes
    get SIGTERM too, and torch's own handler there exits at once: the next batch
    would fail with "DataLoader worker ... is killed by signal: Terminated"
    before the step boundary where the trainer stops. The trainer process owns
    its loader processes and stops them itself.
    """
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preemption:
    """The flag, its signal handlers, and the agreement at step boundaries.

    ``agree(local)`` returns True when any rank's flag is set; it is a
    collective, called by every rank at every optimizer step.
    """

    def __init__(self, agree: Callable[[bool], bool], signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.agree = agree
        self.received: str | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.warning("%s received: stopping at the next optimizer-step boundary, after a checkpoint",
                        self.received)  # fmt: skip

    @property
    def requested(self) -> bool:
        return self.received is not None

    def stop_now(self) -> bool:
        """True on every rank as soon as any rank was signalled (one collective)."""
        return self.agree(self.requested)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
