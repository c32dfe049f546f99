"""The signals ``ddp-service launch`` handles before torchrun's agent does, kept until it does."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("service.ops.launcher")


class Signalled(Exception):
    """A handled signal before the agent runs (torch, whose exception the agent expects, is not loaded yet)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.sigval = signal.Signals(signum)


class EarlySignals:
    """The handled signals that reach launch before torchrun's agent handles them itself, kept.

    Each of launch's handlers raises, to leave at once whatever it waits in (loading torch, the first
    rendezvous), and also records the signal here: a raise can be swallowed on its way up (an ``except
    Exception`` in library code, or a ``__del__`` or weakref callback, where Python prints "Exception ignored"
    and goes on), and the job then trained to completion after its SIGTERM (seen under load). So launch checks
    the record before it starts the agent (:meth:`check`), and while the agent runs a thread waits for the
    agent's own handlers to be installed (when it starts the workers) and sends a recorded signal once more to
    this process (:meth:`redeliver`): the agent then stops the workers as for any signal.
    """

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self.honoured = False
        self.ours: set[Any] = set()

    def handler(self, raise_it: Any) -> Any:
        """A handler that records the signal, then calls ``raise_it(signum)``."""

        def handle(signum: int, frame: FrameType | None) -> None:
            self.received.append(signal.Signals(signum))
            raise_it(signum)

        self.ours.add(handle)
        return handle

    def unhonoured(self) -> bool:
        """A signal was recorded and not yet passed on to the agent."""
        return bool(self.received) and not self.honoured

    def check(self) -> None:
        """Raise for a signal that was recorded and not honoured (its raise was swallowed)."""
        if self.unhonoured():
            raise Signalled(self.received[0])

    def redeliver(self, done: threading.Event, poll: float = 0.02) -> None:
        """Until ``done``: once the agent's own handler of a recorded, unhonoured signal is in place, send it."""
        while not done.wait(poll):
            if not self.received or self.honoured:
                continue
            sig = self.received[0]
            if signal.getsignal(sig) not in (*self.ours, signal.SIG_DFL, signal.SIG_IGN, None):
                self.honoured = True
                log.warning("launch: %s came while torchrun's agent was starting and was lost on its way; "
                            "passing it to the agent now", sig.name)  # fmt: skip
                os.kill(os.getpid(), sig)
                return


def raise_signalled(signum: int) -> None:
    raise Signalled(signum)


def handled_signals(names: str) -> list[signal.Signals]:
    """The signals of a torchrun ``--signals-to-handle`` list (SIGTERM,SIGUSR1); unknown names are left out."""
    found = (getattr(signal, name.strip(), None) for name in names.split(","))
    return [sig for sig in found if isinstance(sig, signal.Signals)]


def restore_signals(names: str) -> None:
    """torchrun's handlers raise in this process; once the agent is done, a signal has its default effect."""
    for sig in handled_signals(names):
        signal.signal(sig, signal.SIG_DFL)
