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

A script with its own loop (``launch --script``) may never create the ``Session`` that releases them: there
:func:`give_up_after` bounds the hold. A stop signal that no session has taken within that many seconds ends the
process as that signal would have (exit ``128 + signum``: 143 for SIGTERM, as a shell reports a worker that
plain torchrun's SIGTERM ended). A session created in that time still gets every signal that came before it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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
        self.grace: float | None = None  # give_up_after's bound; None: held until release
        self.lock = threading.Lock()

    def note(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signal.Signals(signum))
        if self.grace is not None:
            threading.Thread(target=self._expire, args=(signum, self.grace), name="held-signal", daemon=True).start()

    def _expire(self, signum: int, after: float) -> None:
        """``after`` seconds on, a signal still held ends the process, as its default action would have."""
        time.sleep(after)
        with self.lock:
            if not self.previous:
                return  # released: the command's own handler has it
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(128 + signum)


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


def give_up_after(seconds: float) -> None:
    """From now on, a held stop signal that :func:`release` has not delivered within ``seconds`` ends the process
    with ``128 + signum`` (module docstring): a script that never creates a ``Session`` stops as fast as it would
    without the hold."""
    _HELD.grace = seconds


def started() -> float | None:
    """``time.time()`` at the program's first line (:func:`hold`), or None when it did not run (a library use)."""
    return _HELD.since


def release() -> list[signal.Signals]:
    """The command has its handlers: give back the ones it did not replace, then send each noted signal again.
    Returns the signals sent."""
    with _HELD.lock:
        previous, pending = _HELD.previous, list(_HELD.pending)
        _HELD.previous, _HELD.pending = {}, []
    for sig, handler in previous.items():
        if signal.getsignal(sig) == _HELD.note:
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    for sig in pending:
        os.kill(os.getpid(), sig)
    return pending
