"""Preemption: SIGTERM or SIGUSR1 sets a flag; at the next optimizer-step boundary every rank learns it.

A signal handler only sets a flag, so no rank dies inside a collective. The
``train`` command installs it first thing, before torch loads, the run_dir
lock, the process group and the resume, so a signal in any of them is kept.
The loop asks :meth:`Preemption.stop_now` after each optimizer step; one small
all-reduce (MAX over the ranks' flags) makes a signal that reached one rank,
or one node, stop them all at the same step. With steps of a few
milliseconds the ranks check every few steps instead, about every 0.1 s (see
:class:`Preemption`), and such a check does not wait: its all-reduce runs
during the next step and is read at that step's boundary, so the check costs
the step nothing but issuing it.
The loop also agrees once before the first step and after each evaluation
(:meth:`Preemption.stop_here`), so a signal during start-up, an evaluation or
a checkpoint stops the job at the step it stands at. Rank 0 then saves,
everyone meets at a barrier, and the workers exit with :data:`EXIT_PREEMPTED`.

Exit codes of a worker (and of ``ddp-service train``):

- ``0``: completed;
- ``75`` (``EX_TEMPFAIL``): preempted; the checkpoint of that step is saved,
  and the same command resumes from it. Non-zero on purpose: the torchrun
  agents of the nodes that were *not* signalled must see their workers stop,
  restart them and re-rendezvous without the node that left;
- ``1``: failed; also when rank 0 lost the ``run_dir`` lock (another job may
  own the directory now): every rank stops at the agreed step, and nothing
  more is saved there;
- ``2``: bad input refused before training (a config, a resume that does not
  fit, what a script keeps or feeds): nothing written, ``summary.json`` left as
  it was;
- a script's own ``sys.exit(N)`` in a session: ``N`` (0 is completed).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from types import FrameType

log = logging.getLogger(__name__)

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 75
EXIT_REFUSED = 2
STATUS_CODES = {"completed": EXIT_COMPLETED, "preempted": EXIT_PREEMPTED, "lock_lost": EXIT_FAILED}


def exit_code_of(exc: BaseException | None) -> int:
    """The exit status ``exc`` gives a process that does not catch it, as Python computes it: a ``SystemExit``'s
    code (None: 0; not a number: 1, its text printed), 1 for any other exception, 0 for none."""
    if exc is None:
        return EXIT_COMPLETED
    if not isinstance(exc, SystemExit):
        return EXIT_FAILED
    code = exc.code
    if code is None:
        return EXIT_COMPLETED
    return int(code) if isinstance(code, int) else EXIT_FAILED


SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MAX_STEPS_BETWEEN_CHECKS = 1000
STOPS = (None, "preempted", "lock_lost")  # what the agreement's MAX over the ranks' codes means: the gravest wins


def ignore_in_data_workers(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: loader processes ignore the preemption signals.

    torchrun signals its workers' whole process group, so the loader processes
    get SIGTERM too, and torch's own handler there exits at once: the next batch
    would fail with "DataLoader worker ... is killed by signal: Terminated"
    before the step boundary where the trainer stops. The trainer process owns
    its loader processes and stops them itself.

    The worker starts with the signals blocked (:func:`held_back`, around the
    loader's start), so one that came before this point is still pending:
    ``SIG_IGN`` discards it, and only then are the signals unblocked.
    """
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def ignore_stop_signals() -> None:
    """This process is on its way out with its own exit status: from now on a stop signal (the agent's SIGTERM, sent
    once a peer exited first) cannot change that status. Python's finalization sets the handlers it installed back
    to the default, which a signal in its last moments would die of, but leaves ``SIG_IGN`` alone. Main thread."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing to do there
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def held_back(signals: tuple[signal.Signals, ...] = SIGNALS) -> Iterator[None]:
    """Block ``signals`` in this thread while it starts DataLoader worker processes.

    A forked (or spawned) child inherits the blocked mask, so it cannot die of
    a signal in the moment between its birth and :func:`ignore_in_data_workers`
    (torch installs a SIGTERM handler that exits there first). The trainer loses
    nothing: the other threads of the process take the signal meanwhile, or it
    stays pending until the mask is restored, and then sets the flag.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


Agreed = Callable[[], tuple[int, int]]  # waits for a started agreement: (the gravest code, the smallest proposal)


def alone(local: int, proposal: int) -> Agreed:
    """The agreement of a process that is not in a process group yet: its own flag and proposal."""
    return lambda: (local, proposal)


class Preemption:
    """The flag, its signal handlers, and the agreement at step boundaries.

    ``agree(local, every)`` starts a collective (one all-reduce of two
    integers) that every rank starts at the same boundaries, and returns the
    call that waits for it: whether any rank's flag is set, and the smallest of
    the ranks' proposals for how many steps to go until the next check. Each
    rank proposes enough steps to cover ``interval`` seconds at its current
    step time, so the check costs little when steps are a few milliseconds,
    and happens at every boundary once a step takes ``interval`` or longer.
    While the agreed interval is more than one step, a check is read one step
    after it started (its all-reduce runs during that step, and nobody waits
    for it); at one step or less, and in :meth:`stop_here`, it is read at once.
    Both choices are made from agreed numbers, so every rank reads the same
    check at the same boundary. A stop therefore comes at most about
    ``interval`` seconds and one short step of training after the signal, at
    the same step on every rank. A rank's flag is a code into :data:`STOPS`, so
    the same agreement also carries :meth:`lose_lock`'s stop to every rank.

    The handlers go in when the object is made, before any process group: the
    agreement is :func:`alone` until :meth:`connect` makes it the collective.

    A Python handler runs only when the main thread returns to the
    interpreter, which a rank blocked inside a collective whose peer is gone
    never does. So the object also gives the signal's C-level handler a wakeup
    fd (:func:`signal.set_wakeup_fd`, made in the main thread): any thread can
    ask :meth:`signalled_at` when a signal came, while the main thread is stuck.
    """

    def __init__(
        self,
        agree: Callable[[int, int], Agreed] = alone,
        interval: float = 0.1,
        signals: tuple[signal.Signals, ...] = SIGNALS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agree = agree
        self.interval = interval
        self.clock = clock
        self.received: str | None = None
        self.received_at: float | None = None  # ``clock()`` when a signal came (the handler or the wakeup fd)
        self.lock_lost: str | None = None
        self._every = 1  # the agreed number of boundaries from one check's start to the next
        self._steps = 0  # boundaries since the last check started: the next is due at ``_every``
        self._pending: Agreed | None = None  # a check started at the last boundary, read at this one
        self._last_check = clock()
        self._numbers = {int(sig) for sig in signals}
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        self._wakeup: tuple[int, int] | None = os.pipe()
        for fd in self._wakeup:
            os.set_blocking(fd, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the handler's flag alone
            self._close_wakeup()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = self.clock()
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.warning("%s received: stopping at the next optimizer-step boundary, after a checkpoint",
                        self.received)  # fmt: skip

    def connect(self, agree: Callable[[int, int], Agreed]) -> None:
        """From now on the flag is agreed with every rank (the control group is up)."""
        self.agree = agree

    @property
    def requested(self) -> bool:
        return self.received is not None

    def lose_lock(self, why: str) -> None:
        """Stop every rank at the next agreed boundary, with no checkpoint: run_dir may belong to another job now."""
        self.lock_lost = why

    def stop_here(self) -> str | None:
        """An agreement now, whatever the steps since the last: before the first step and after an evaluation."""
        return self._read_pending() or self._check(wait=True)

    def stop_now(self) -> str | None:
        """Called after every optimizer step; on every rank, at the same step, why to stop (see :data:`STOPS`)."""
        self._steps += 1
        if stop := self._read_pending():
            return stop
        if self._steps < self._every:
            return None
        return self._check(wait=self._every <= 1)  # short steps (agreed): read it at the next boundary

    def _check(self, wait: bool) -> str | None:
        now = self.clock()
        # Over the steps since the last check (none: start-up or an evaluation, timed as one step), not over the
        # agreed interval: an evaluation's check a few steps after the last would otherwise see them as short steps.
        step_seconds = max((now - self._last_check) / max(self._steps, 1), 1e-6)
        # No step since the last check (start-up, or an evaluation right after a check): the time since is no step's,
        # and a quick evaluation would look like a short step and put the next check many long steps away, past a
        # signal that comes meanwhile. The next boundary checks again and times real steps.
        short = self._steps == 0 and now - self._last_check < self.interval
        self._last_check, self._steps = now, 0
        proposal = 1 if short else max(1, min(MAX_STEPS_BETWEEN_CHECKS, math.ceil(self.interval / step_seconds)))
        code = 2 if self.lock_lost is not None else 1 if self.requested else 0
        self._pending = self.agree(code, proposal)
        return self._read_pending() if wait else None

    def _read_pending(self) -> str | None:
        """The check in flight, read (it started at this boundary, or one ago); the next starts ``every`` boundaries
        after it did."""
        if self._pending is None:
            return None
        agreed, self._pending = self._pending, None
        stop, self._every = agreed()
        return STOPS[stop]

    def settle(self) -> None:
        """Wait for a check still in flight (the run's last steps): before the process group goes."""
        self._read_pending()

    def signalled_at(self) -> float | None:
        """``clock()`` when the first of the signals reached this process; any thread may ask, at any time."""
        if self.received_at is None and self._wakeup is not None:
            with contextlib.suppress(OSError):  # BlockingIOError: nothing came
                if self._numbers.intersection(os.read(self._wakeup[0], 4096)) and self.received_at is None:
                    self.received_at = self.clock()
        return self.received_at

    def _close_wakeup(self) -> None:
        if self._wakeup is not None:
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._wakeup is not None:
            with contextlib.suppress(ValueError, OSError):  # another thread; or the fd before ours is closed by now
                current = signal.set_wakeup_fd(-1)
                # Ours: give back the one before it. Another object's (made after this one): leave it in place.
                signal.set_wakeup_fd(self._previous_wakeup if current == self._wakeup[1] else current)
            self._close_wakeup()
