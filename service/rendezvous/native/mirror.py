"""A local copy of every key under one etcd prefix, kept current by a watch (list, then watch).

The native rendezvous decides everything from this copy, so no node polls
etcd. When the watch breaks (an etcd restart, a fail-over to another member,
a refused login token), the copy is rebuilt from a fresh read of the whole
prefix and the watch resumes after that read's revision. Decisions are taken
from the keys present, not from the events seen, so a key deleted while the
watch was down (a node that died meanwhile, even with its events compacted
away) is still noticed: it is simply absent from the fresh read.

If etcd stays unreachable beyond the client's grace window, :attr:`error`
holds the reason and every waiter is woken to raise it.

A value that ``forgery`` refuses (on a signed run: unsigned, or signed with
another secret) is left out of the copy, as if its key were absent, and is
deleted from etcd (only while the key still holds that value), with a
warning: nobody obeys it, and it cannot block the run's transactions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyetcd.events import DeleteEvent
from pyetcd.watch import WatchResponse

from service.rendezvous.client import EtcdClient, EtcdError, WatchCompactedError

log = logging.getLogger(__name__)
_COMPACTED_RETRIES = 5


@dataclass(frozen=True)
class Entry:
    """One key as last seen: value and revisions (create_revision orders joins)."""

    value: bytes
    create_revision: int
    mod_revision: int


class PrefixMirror:
    """Every key under ``prefix`` with its value, and the etcd revision the copy reflects."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        major: Callable[[bytes], bool] = lambda key: True,
        forgery: Callable[[bytes, bytes], str | None] = lambda key, value: None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._major = major
        self._forgery = forgery
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        # Woken only by deletions, by keys ``major`` names, by a fresh read and by errors: waiters that need
        # no other change sleep through the N joins of a big round.
        self.major_cond = threading.Condition(lock)
        self._entries: dict[bytes, Entry] = {}
        self._revision = 0
        self._watcher: Any = None
        self._generation = 0
        self._stopped = False
        self.error: EtcdError | None = None
        self.resyncs = 0  # how often the watch was rebuilt, for tests and the benchmark
        self.deletions = 0  # keys deleted (or a fresh read that may have dropped some), so far

    # -- reading the copy (callers hold ``cond`` to see one consistent snapshot) --------------
    @property
    def revision(self) -> int:
        return self._revision

    def snapshot(self) -> tuple[int, dict[bytes, Entry]]:
        with self.cond:
            return self._revision, dict(self._entries)

    def items(self) -> dict[bytes, Entry]:
        """The entries; call with ``cond`` held."""
        return self._entries

    def wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait (``cond`` held by the caller) until ``ready()`` or the deadline; wakes on every change."""
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.cond.wait(left)
        return True

    # -- keeping it current ----------------------------------------------------
    def start(self) -> None:
        """Read the prefix and start watching it; raises ``EtcdError`` when etcd cannot be used."""
        self._resync()

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            watcher, self._watcher = self._watcher, None
            self.cond.notify_all()
            self.major_cond.notify_all()
        if watcher is not None:
            watcher.close()

    def _resync(self) -> None:
        for _ in range(_COMPACTED_RETRIES):
            try:
                return self._resync_once()
            except WatchCompactedError:  # compacted between the read and the watch: read again
                continue
        raise EtcdError(f"etcd compacted the history under {self._prefix.decode()} faster than it could be watched.")

    def _resync_once(self) -> None:
        revision, kvs = self._client.list_prefix(self._prefix, "reading the rendezvous keys")
        with self.cond:
            if self._stopped:
                return
            self._generation += 1
            generation = self._generation
            forged = [(kv.key, kv.value) for kv in kvs if self._forgery(kv.key, kv.value) is not None]
            refused = {key for key, _ in forged}
            self._entries = {
                kv.key: Entry(kv.value, kv.create_revision, kv.mod_revision) for kv in kvs if kv.key not in refused
            }
            self.deletions += 1
            self._revision = max(self._revision, revision)
            self.cond.notify_all()
            self.major_cond.notify_all()
        watcher = self._client.watch_prefix(
            self._prefix,
            revision + 1,
            lambda response: self._on_response(generation, response),
            "watching the rendezvous keys",
        )
        with self.cond:
            if self._stopped or generation != self._generation:
                stale, watcher = watcher, None
            else:
                stale, self._watcher = self._watcher, watcher
        if stale is not None:
            stale.close()
        self._purge(forged)

    def _purge(self, forged: list[tuple[bytes, bytes]]) -> None:
        """Delete forged values (each only while its key still holds it), off the watch's thread."""
        if forged:
            threading.Thread(target=self._delete_forged, args=(forged,), name="etcd3-rdzv-purge", daemon=True).start()

    def _delete_forged(self, forged: list[tuple[bytes, bytes]]) -> None:
        for key, value in forged:
            name = key.decode(errors="replace")
            log.warning(
                "The rendezvous key %s in etcd holds a value that no agent of this signed run wrote (%s): it is "
                "ignored and deleted. Someone without the run's secret writes under its prefix; restrict it with "
                "etcd's authentication, and give every agent the same 'secret_file'.",
                name,
                self._forgery(key, value),
            )
            try:
                self._client.delete_if_value(key, value, "deleting a forged rendezvous key")
            except EtcdError as exc:
                log.warning("Deleting the forged rendezvous key %s failed (%s); it stays ignored.", name, exc)

    def _on_response(self, generation: int, response: Any) -> None:
        if isinstance(response, WatchResponse):
            with self.cond:
                if generation != self._generation:
                    return
                major = False
                forged = []
                for event in response.events:
                    refused = not isinstance(event, DeleteEvent) and self._forgery(event.key, event.value) is not None
                    if refused:
                        forged.append((event.key, event.value))
                    if isinstance(event, DeleteEvent) or refused:  # a forged value counts as no value
                        if self._entries.pop(event.key, None) is not None or isinstance(event, DeleteEvent):
                            self.deletions += 1
                            major = True
                    else:
                        self._entries[event.key] = Entry(event.value, event.create_revision, event.mod_revision)
                        major = major or self._major(event.key)
                self._revision = max(self._revision, int(response.header.revision))
                self.cond.notify_all()
                if major:
                    self.major_cond.notify_all()
            self._purge(forged)
            return
        # The stream ended (an error, or None when closed): rebuild unless stopped or superseded.
        with self.cond:
            if self._stopped or generation != self._generation:
                return
        log.info("The rendezvous watch on %s broke (%s); reading the keys again.", self._prefix.decode(), response)
        threading.Thread(target=self._recover, name="etcd3-rdzv-resync", daemon=True).start()

    def _recover(self) -> None:
        try:
            self._resync()
            with self.cond:
                self.resyncs += 1
        except EtcdError as exc:
            with self.cond:
                self.error = exc
                self.cond.notify_all()
                self.major_cond.notify_all()
        except Exception as exc:  # never let a bug here leave waiters asleep
            log.exception("Rebuilding the rendezvous watch failed (%s).", type(exc).__name__)
            with self.cond:
                self.error = EtcdError(f"Rebuilding the rendezvous watch failed: {exc}")
                self.cond.notify_all()
                self.major_cond.notify_all()
