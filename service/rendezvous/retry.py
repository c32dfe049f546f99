"""How long, and how often, the etcd client retries a request (``client.py``): its windows and its backoff.

* **At start** (before the first answer), an etcd that does not answer gets one
  request deadline (``read_timeout``) per endpoint: nothing listening, a server
  that does not speak HTTP/2, or a TLS refusal fail the agent at once.
* **A start that meets an etcd that is there but slow** (a handshake or a
  request that ran out of time, etcd saying it is busy or has no leader yet:
  hundreds of agents connecting at once, a cluster still forming) is retried
  until ``start_timeout`` after the start began; the rendezvous sets it to its
  ``join_timeout``. This holds for every request of the start (the run lease,
  the job record, the node lease, the first read and the watch) until the
  agent calls :meth:`RetryWindow.end_start`.
* **In a running job**, a failing request is retried for ``grace_period`` from
  the first failure after a success (an etcd restart, a lost member).

Each try is bounded by ``read_timeout``, so a frozen member is still left in
time, and a request gives up at most one try (``read_timeout``, twice with a
login) after its window ends. Between tries the pause doubles from 50 ms up to
0.5 s (2 s during a slow start, so a thousand agents do not hammer a busy
etcd), drawn from half to all of its step, and never past the window's end.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from service.rendezvous.options import ClientOptions

T = TypeVar("T")

# What etcd answers (often as UNKNOWN) while it has no quorum or elects a leader: worth retrying.
TRANSIENT_DETAILS = (
    "context deadline exceeded",
    "etcdserver: request timed out",
    "etcdserver: leader changed",
    "etcdserver: no leader",
    "etcdserver: too many requests",
)
# What an etcd that is there but slow answers, besides DEADLINE_EXCEEDED: at start, retried until start_timeout.
SLOW_DETAILS = ("timed out", "deadline exceeded", "handshaker shutdown", *TRANSIENT_DETAILS[1:])
PAUSE_CAP = 0.5  # the longest pause between tries
SLOW_START_CAP = 2.0  # the longest pause between the tries of a slow start


class Backoff:
    """The pauses between the tries of one request: doubling from ``first`` up to ``cap``, each drawn from half
    to all of its step (the jitter spreads the retries of agents that failed together), never past the time left.
    """

    def __init__(self, first: float = 0.05, cap: float = PAUSE_CAP, draw: Callable[[], float] = random.random) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"A backoff needs 0 < first <= cap; got first={first:g}, cap={cap:g}.")
        self.first, self.cap, self._draw, self._step = first, cap, draw, first

    def pause(self, left: float, cap: float | None = None) -> float:
        """Seconds to wait before the next try, ``left`` seconds before the window ends (0 once it has ended).

        ``cap`` raises (or lowers) the longest pause for this call on.
        """
        if cap is not None:
            self.cap = cap
        step = min(self._step, self.cap)
        self._step = min(step * 2, self.cap)
        return max(0.0, min(left, step * (0.5 + 0.5 * self._draw())))


class RetryWindow:
    """The outage bookkeeping of one client: whether it ever got an answer, since when requests fail, and so how
    long a failing request may still be retried (``left``). ``clock`` is ``time.monotonic`` but for tests."""

    def __init__(self, options: ClientOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self.created = clock()
        self.outage_since: float | None = None
        self.outage_ended: float | None = None  # when etcd last answered again after failing
        self.connected_once = False
        self.last_error: str | None = None
        self.starting = options.start_timeout is not None  # until end_start(): slow answers are retried longer
        self.slow = False  # this start met an etcd that is there but slow

    # -- what happened ----------------------------------------------------------------
    def ok(self) -> None:
        """A request was answered."""
        self.connected_once = True
        if self.outage_since is not None:
            self.outage_ended = self._clock()
        self.outage_since = None
        self.last_error = None

    def failed(self, error: str | None = None, timed_out: bool = False) -> None:
        """A try failed (``error``: what gRPC or etcd said; ``timed_out``: it ran out of its deadline)."""
        if self.outage_since is None:
            self.outage_since = self._clock()
        if error is not None:
            self.last_error = error
        if timed_out or (error is not None and any(d in error.lower() for d in SLOW_DETAILS)):
            self.slow = True

    def end_start(self) -> None:
        """The agent is connected and in the run: from now on the grace window applies."""
        self.starting = False

    # -- what follows -------------------------------------------------------------------
    @property
    def extended(self) -> bool:
        """Whether the window reaches ``start_timeout``: a start that met an etcd that is there but slow."""
        return self.starting and self.slow and self.options.start_timeout is not None

    @property
    def start_window(self) -> float:
        """How long a start tries an etcd that does not answer: one request deadline per endpoint."""
        return self.options.read_timeout * len(self.options.endpoints)

    def left(self) -> float:
        """Seconds left to retry (0 or less: give up)."""
        now = self._clock()
        if not self.connected_once:
            end = self.created + self.start_window
        else:
            end = (self.outage_since if self.outage_since is not None else now) + self.options.grace_period
        if self.extended:
            end = max(end, self.created + float(self.options.start_timeout or 0))
        return end - now

    def pause_cap(self) -> float:
        """The longest pause between tries now: longer during a slow start."""
        return SLOW_START_CAP if self.extended else PAUSE_CAP

    def waited(self) -> float:
        """The window a request that gives up was retried for, for its message."""
        waited = self.options.grace_period if self.connected_once else self.start_window
        return max(waited, float(self.options.start_timeout or 0)) if self.extended else waited

    def unreachable_within(self, seconds: float) -> bool:
        """Whether a request went unanswered now or in the last ``seconds``."""
        ended = self.outage_ended
        return self.outage_since is not None or (ended is not None and self._clock() - ended <= seconds)


def keep_trying(
    attempt: Callable[[], T],
    window: RetryWindow,
    retryable: type[BaseException],
    before_pause: Callable[[float], None] = lambda left: None,
    sleep: Callable[[float], None] = time.sleep,
    backoff: Backoff | None = None,
) -> T:
    """``attempt()`` until it returns; a ``retryable`` failure is tried again, after a pause, while ``window``
    has time left, else raised. ``attempt`` reports its failures to ``window`` (``RetryWindow.failed``)."""
    backoff = backoff or Backoff()
    while True:
        try:
            result = attempt()
        except retryable:
            left = window.left()
            if left <= 0:
                raise
            before_pause(left)
            sleep(backoff.pause(left, cap=window.pause_cap()))
            continue
        window.ok()
        return result
