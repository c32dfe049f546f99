"""The stop signals that come before a command has its handlers: held from the first line that can, and delivered
once it has them.

``ddp-service`` and ``python -m service`` spend their first second or more importing (pydantic, then torch), and
a SIGTERM in that time killed the process with the signal's default action: a launch ended -15 instead of 75
(preempted), a worker died before its preemption handler existed. :func:`hold` is the first thing the command
line module does, before its heavy imports (this module imports nothing but the standard library); it installs
handlers that only note the signal. Once the command has installed its own (the preemption handler of
``train``, the launcher's), :func:`release` gives back what it did not replace and sends every noted signal to
this process again, so it reaches the real handler as if it had come just then. Signals are process-wide, and so
is this state.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


class _Held:
    def __init__(self) -> None:
        self.previous: dict[signal.Signals, Any] = {}
        self.pending: list[signal.Signals] = []

    def note(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signal.Signals(signum))


_HELD = _Held()


def hold() -> None:
    """Note the stop signals from now on (the main thread only; elsewhere, and a second time, nothing)."""
    if _HELD.previous or threading.current_thread() is not threading.main_thread():
        return
    _HELD.previous = {sig: signal.signal(sig, _HELD.note) for sig in HELD}


def release() -> list[signal.Signals]:
    """The command has its handlers: give back the ones it did not replace, then send each noted signal again.
    Returns the signals sent."""
    previous, pending = _HELD.previous, list(_HELD.pending)
    _HELD.previous, _HELD.pending = {}, []
    for sig, handler in previous.items():
        if signal.getsignal(sig) == _HELD.note:
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    for sig in pending:
        os.kill(os.getpid(), sig)
    return pending
