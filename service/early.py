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

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


class _Held:
    def __init__(self) -> None:
        self.previous: dict[signal.Signals, Any] = {}
        self.pending: list[signal.Signals] = []
        self.since: float | None = None  # time.time() at the program's first line (start-up's first mark)

    def note(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signal.Signals(signum))


_HELD = _Held()


def hold(defaults: bool = False) -> None:
    """Note the stop signals from now on (the main thread only; elsewhere, and a second time, nothing).

    ``defaults``: start as a new interpreter would, whatever this process inherited (a worker forked from
    ``launch``'s fork server, which ignores them: :func:`ignore`): none is blocked, and what :func:`release` gives
    back is each signal's default action."""
    if _HELD.previous or threading.current_thread() is not threading.main_thread():
        return
    _HELD.since = _HELD.since or time.time()
    _HELD.previous = {sig: signal.signal(sig, _HELD.note) for sig in HELD}
    if defaults:
        _HELD.previous = dict.fromkeys(HELD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)


@contextlib.contextmanager
def ignore_in_children(signals: tuple[signal.Signals, ...] = HELD) -> Iterator[None]:
    """Processes started (fork and exec) inside this block ignore ``signals``: a helper that must outlive them,
    such as multiprocessing's resource tracker. They are blocked meanwhile (and stay blocked in those children),
    so one that comes now reaches this process's own handler at the end of the block, not the ignore."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def ignore() -> None:
    """This process ignores the stop signals from now on (``launch``'s fork server: :mod:`service.ops.fork_server`)."""
    for sig in HELD:
        signal.signal(sig, signal.SIG_IGN)


def started() -> float | None:
    """``time.time()`` at the program's first line (:func:`hold`), or None when it did not run (a library use)."""
    return _HELD.since


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
