"""One etcd watch stream that carries many watches, added and cancelled while it runs, none of them waited for.

pyetcd's ``Watcher`` waits for each watch's confirmation, one at a time, and
after a confirmation that came too late it hands the next one to the wrong
watch. Here creating or cancelling a watch is one message on the stream. etcd
confirms creations in the order they were sent and sends no event of a watch
before its confirmation, so each confirmation names the watch the oldest
unconfirmed request asked for: every response reaches the watch it belongs to.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc

from service.rendezvous.requests import WatchSpec


class WatchStream:
    """A bidirectional Watch call; ``on_response(tag, response)`` gets each watch's responses (etcd's messages),
    ``on_end(error)`` the stream's end (``None`` only when closed here: an end from etcd's side, even a clean one,
    comes with an error)."""

    def __init__(
        self,
        stub: Any,
        metadata: Any,
        credentials: Any,
        on_response: Callable[[Hashable, Any], None],
        on_end: Callable[[BaseException | None], None],
        meter: list[int] | None = None,
    ) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: deque[Hashable] = deque()  # watches asked for, not yet confirmed, in the order sent
        self._ids: dict[int, Hashable] = {}  # etcd's watch id -> the watch
        self._tags: dict[Hashable, int] = {}
        self._cancelled: set[Hashable] = set()  # cancelled before etcd confirmed them
        self._refused: dict[Hashable, Any] = {}  # confirmations that came cancelled (compacted, refused)
        self._on_response, self._on_end = on_response, on_end
        self._ended: BaseException | None = None
        self._closed = False
        self.done = False
        self.meter = [0, 0] if meter is None else meter  # events received, bytes of all responses: for the benchmark
        self._call = stub.Watch(iter(self._requests.get, None), metadata=metadata, credentials=credentials)
        threading.Thread(target=self._read, name="etcd3-rdzv-watch", daemon=True).start()

    def create(self, tag: Hashable, spec: WatchSpec) -> None:
        """Ask for a watch (no wait); its responses go to ``on_response(tag, ...)``."""
        request = etcdrpc.WatchCreateRequest(key=spec.key, start_revision=spec.start_revision, filters=spec.filters)
        if spec.end is not None:
            request.range_end = spec.end
        with self._lock:
            self._pending.append(tag)
            self._requests.put(etcdrpc.WatchRequest(create_request=request))

    def cancel(self, tag: Hashable) -> None:
        """End the watch ``tag``: none of its responses is delivered from now on."""
        with self._lock:
            watch_id = self._tags.pop(tag, None)
            if watch_id is None:
                if tag in self._pending:
                    self._cancelled.add(tag)
                return
            del self._ids[watch_id]
            self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))

    def confirmed(self, tags: Iterable[Hashable], deadline: float) -> dict[Hashable, Any]:
        """Wait until etcd confirmed every watch of ``tags``; the refused ones (their cancelled confirmations).

        Raises the stream's error if it ended, ``TimeoutError`` at the deadline.
        """
        wanted = set(tags)
        with self._lock:
            while True:
                if self._ended is not None:
                    raise self._ended
                if self.done:
                    raise TimeoutError("the watch stream was closed")
                waiting = wanted - self._tags.keys() - self._refused.keys()
                if not waiting:
                    return {t: self._refused[t] for t in wanted if t in self._refused}
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"etcd did not confirm {len(waiting)} watch(es) in time")
                self._changed.wait(left)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._requests.put(None)
        self._call.cancel()

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            for response in self._call:
                self.meter[0] += len(response.events)
                self.meter[1] += response.ByteSize()
                tag = self._route(response)
                if tag is not None:
                    self._on_response(tag, response)
        except grpc.RpcError as exc:
            error = exc
        with self._lock:
            self.done = True
            closed = self._closed
            if not closed:
                self._ended = error or etcd_exc.ConnectionFailedError()  # etcd ended it: as if unreachable
            ended = self._ended
            self._changed.notify_all()
        self._on_end(ended)  # None only for a stream closed here

    def _route(self, response: Any) -> Hashable | None:
        """The watch ``response`` belongs to; ``None`` for one that is no longer wanted."""
        with self._lock:
            if response.created:
                tag = self._pending.popleft() if self._pending else None
                if tag is None:
                    return None
                self._changed.notify_all()
                if response.canceled:  # refused: its start compacted away, or etcd said no
                    self._refused[tag] = response
                    return None if tag in self._cancelled else tag
                if tag in self._cancelled:  # cancelled while etcd had not named it yet
                    self._cancelled.discard(tag)
                    cancel = etcdrpc.WatchCancelRequest(watch_id=response.watch_id)
                    self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))
                    return None
                self._ids[response.watch_id], self._tags[tag] = tag, response.watch_id
                return tag if response.events else None
            tag = self._ids.get(response.watch_id)
            if tag is not None and response.canceled:  # etcd ended it (compaction while it lagged behind)
                del self._ids[response.watch_id]
                self._tags.pop(tag, None)
            return tag
