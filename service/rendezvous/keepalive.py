"""Lease keep-alives on one LeaseKeepAlive stream kept open, not a new stream for each refresh.

pyetcd's ``refresh_lease`` opens a bidirectional gRPC call for every refresh,
and gRPC starts a thread to feed each such call: 0.84 ms of the process's CPU
per refresh on this project's 2-core machine, against 0.27 ms for a message on
a stream that stays open (``bench/keepalive.py``, etcd 3.5 on loopback). Every agent
refreshes its node lease every ``keep_alive_interval`` and the run lease every
third of its TTL, so at a mass start of many simulated nodes per machine the
streams' set-up was what starved the leases (docs/rendezvous.md, "Scale").

One :class:`KeepAlive` per client serves all its leases, one refresh at a time
(a refresh is one request and its answer; etcd answers a stream's requests in
order). Each refresh still has the client's ``read_timeout``: no answer in
time, and the stream is dropped and the endpoint marked failed, exactly as a
refresh's deadline did, so a frozen member is still left for another. A stream
that ended or failed is replaced at the next refresh, on whatever endpoint and
login token the client uses then.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc


class _Overdue:
    """One thread per process that cancels the keep-alive calls whose answer is overdue.

    A refresh reads its answer from the call itself, in the thread that asked (no reader thread, so no hand-off
    between threads per refresh); this thread, polling ten times a second, is what bounds that read. It starts
    with the first refresh and serves every stream of the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[float, Any]] = {}  # id of a call -> (its deadline, the call)
        self._thread: threading.Thread | None = None

    def watch(self, call: Any, deadline: float) -> None:
        with self._lock:
            self._waiting[id(call)] = (deadline, call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd3-rdzv-keepalive-deadlines", daemon=True)
                self._thread.start()

    def done(self, call: Any) -> bool:
        """Stop watching ``call``; False if it was already cancelled as overdue."""
        with self._lock:
            return self._waiting.pop(id(call), None) is not None

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                overdue = [key for key, (deadline, _) in self._waiting.items() if deadline <= now]
                calls = [self._waiting.pop(key)[1] for key in overdue]
            for call in calls:
                call.cancel()


_OVERDUE = _Overdue()


class _Stream:
    """One open LeaseKeepAlive call on one channel, with the login token it was opened with."""

    def __init__(self, c: Any) -> None:
        self.channel, self.metadata = c.channel, c.metadata
        self._requests: queue.Queue[Any] = queue.Queue()
        stub = etcdrpc.LeaseStub(self.channel)
        self._call = stub.LeaseKeepAlive(iter(self._requests.get, None), metadata=self.metadata,
                                         credentials=c.call_credentials)  # fmt: skip

    def serves(self, c: Any) -> bool:
        """Whether this stream is still open (not ended by etcd, an error or a cancel), on the channel and token the
        client would use now."""
        return not self._call.done() and c.channel is self.channel and c.metadata == self.metadata

    def refresh(self, lease_id: int, timeout: float) -> int:
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        _OVERDUE.watch(self._call, time.monotonic() + timeout)
        try:
            answer = next(self._call)
        except (StopIteration, grpc.RpcError) as exc:
            if not _OVERDUE.done(self._call):
                raise etcd_exc.ConnectionTimeoutError(f"no answer to a lease keep-alive in {timeout:g} s") from None
            if isinstance(exc, StopIteration):
                raise etcd_exc.ConnectionFailedError("etcd ended the lease keep-alive stream") from None
            raise  # the client classifies it as it does any request's error
        _OVERDUE.done(self._call)  # answered, even if cancelled just now (the next refresh then opens a new stream)
        if answer.ID != lease_id:  # cannot happen with one request at a time; never misread another lease's TTL
            raise etcd_exc.ConnectionFailedError(f"a keep-alive for lease {lease_id:x} was answered for {answer.ID:x}")
        return int(answer.TTL)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


class KeepAlive:
    """A client's lease refreshes, all on one stream; thread-safe."""

    def __init__(self, read_timeout: float) -> None:
        self._timeout = read_timeout
        self._lock = threading.Lock()
        self._stream: _Stream | None = None

    def refresh(self, c: Any, lease_id: int) -> int:
        """Refresh ``lease_id`` through the pyetcd client ``c``; its TTL after the refresh, 0 if etcd lacks it."""
        with self._lock:
            if self._stream is not None and not self._stream.serves(c):
                self._drop()
            if self._stream is None:
                self._stream = _Stream(c)
            try:
                return self._stream.refresh(lease_id, self._timeout)
            except BaseException as exc:
                self._drop()
                if isinstance(exc, etcd_exc.ConnectionTimeoutError):  # as a request's deadline does: the next
                    with contextlib.suppress(Exception):  # try may go to another member (bookkeeping only)
                        c.endpoint_in_use.fail()
                raise

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
