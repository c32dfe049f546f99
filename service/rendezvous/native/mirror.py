"""A local copy of the run's keys that matter to this node, kept current by watches on one stream (read, then watch).

The native rendezvous decides everything from this copy, so no node polls etcd. What it watches depends on the
node's part in the round (``watching.py``), so that a join costs every other node no event. Each watched range
keeps all its keys (``FULL``, in :meth:`Mirror.items`), or only what deletions or puts told (``ranges.py``).

When the stream breaks (an etcd restart, a fail-over to another member, a refused login token), every range is
read again in one transaction, at one revision, and the stream is rebuilt from that revision. Decisions are taken
from the keys present, not from the events seen, so a key deleted while the stream was down (a node that died
meanwhile, even with its events compacted away) is still noticed: it is absent from the fresh read. If etcd stays
unreachable beyond the client's grace window, :attr:`Mirror.error` holds the reason and every waiter is woken.

A value that ``forgery`` refuses (on a signed run: unsigned, or signed with another secret) is left out of the
copy, as if its key were absent, and is deleted from etcd (only while the key still holds that value), with a
warning: nobody obeys it, and it cannot block the run's transactions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from service.rendezvous.client import EtcdClient, EtcdError, WatchCompactedError
from service.rendezvous.native.ranges import FULL, Entry, Range
from service.rendezvous.requests import DELETES, WatchSpec
from service.rendezvous.watchstream import WatchStream

log = logging.getLogger(__name__)
_COMPACTED_RETRIES = 5
_DELETE = 1  # etcd's Event.DELETE


class Mirror:
    """The watched ranges of one node, on one watch stream, and the revision the copy reflects."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        major: Callable[[bytes], bool] = lambda key: True,
        forgery: Callable[[bytes, bytes], str | None] = lambda key, value: None,
    ) -> None:
        self._client = client
        self._prefix = prefix  # every range lies under it
        self._major = major
        self._forgery = forgery
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        # Woken only by deletions, by keys ``major`` names, by a fresh read and by errors: waiters that need
        # no other change sleep through the N joins of a big round.
        self.major_cond = threading.Condition(lock)
        self._entries: dict[bytes, Entry] = {}
        self._ranges: dict[str, Range] = {}
        self._revision = 0
        self._stream: WatchStream | None = None
        self._generation = 0
        self._recovering = 0  # the generation whose broken stream is being rebuilt
        self._lost_while_opening = 0  # a generation whose stream ended, or had a watch ended, before it was kept
        self._held: tuple[int, list[tuple[Range, Any]]] | None = None  # a generation's events held for its read
        self._stopped = False
        self.error: EtcdError | None = None
        self.resyncs = 0  # how often the stream was rebuilt, for tests and the benchmark
        self.deletions = 0  # keys deleted (or a fresh read that may have dropped some), so far
        self.received = [0, 0]  # watch events and bytes received on all its streams, for the benchmark

    # -- reading the copy (callers hold ``cond`` to see one consistent snapshot) --------------
    @property
    def revision(self) -> int:
        return self._revision

    def items(self) -> dict[bytes, Entry]:
        """The keys of the FULL ranges; call with ``cond`` held."""
        return self._entries

    def range(self, name: str) -> Range | None:
        """The range called ``name``; call with ``cond`` held."""
        return self._ranges.get(name)

    def wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait (``cond`` held by the caller) until ``ready()`` or the deadline; wakes on every change."""
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.cond.wait(left)
        return True

    # -- choosing what to watch -------------------------------------------------------------
    def start(self, ranges: list[Range]) -> None:
        """Read ``ranges`` and watch them on a new stream; raises ``EtcdError`` when etcd cannot be used."""
        with self.cond:
            for rng in ranges:
                self._ranges[rng.name] = rng
        self._resync()

    def add(self, rng: Range) -> None:
        """Watch ``rng`` too: from ``rng.start`` (the caller knows the range up to it), or after reading it now.

        Raises ``EtcdError`` when etcd cannot be used. The watch is asked for, not waited for: etcd sends its
        events from ``rng.start`` on whenever it confirms it. A stream that breaks meanwhile is rebuilt with it.
        """
        with self.cond:
            if self._stopped:
                return
            old = self._ranges.pop(rng.name, None)
            if old is not None:
                self._drop(old)
            self._ranges[rng.name] = rng
            generation = self._generation
        if rng.start == 0 and not self._read_into(rng, generation):
            return  # the stream was rebuilt meanwhile, this range with it
        with self.cond:
            if generation == self._generation and self._stream is not None and self._ranges.get(rng.name) is rng:
                self._stream.create(rng, self._spec(rng))
            # else: a rebuild is under way, and it takes this range along

    def remove(self, name: str) -> None:
        """Stop watching the range ``name`` (and forget its keys)."""
        with self.cond:
            rng = self._ranges.pop(name, None)
            if rng is not None:
                self._drop(rng)

    def set_until(self, name: str, until: Callable[[Range], bool]) -> None:
        """Stop watching ``name`` once ``until(range)`` holds (at once if it does already)."""
        with self.cond:
            rng = self._ranges.get(name)
            if rng is None or rng.done:
                return
            rng.until = until
            if until(rng):
                self._finish(rng)

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            stream, self._stream = self._stream, None
            self.cond.notify_all()
            self.major_cond.notify_all()
        if stream is not None:
            stream.close()

    def _drop(self, rng: Range) -> None:
        """Forget ``rng`` and cancel its watch (``cond`` held)."""
        self._forget(rng)
        if self._stream is not None and not rng.done:
            self._stream.cancel(rng)

    def _finish(self, rng: Range) -> None:
        """``rng.until`` holds: cancel its watch, keep what it saw (``cond`` held)."""
        rng.done = True
        if self._stream is not None:
            self._stream.cancel(rng)

    def _forget(self, rng: Range) -> None:
        if rng.kind == FULL:
            for key in [k for k in self._entries if rng.covers(k)]:
                del self._entries[key]

    @staticmethod
    def _spec(rng: Range) -> WatchSpec:
        return WatchSpec(rng.key, rng.end, rng.start, rng.kind)

    # -- reading -------------------------------------------------------------------------------
    def _read_into(self, rng: Range, generation: int) -> bool:
        """Read ``rng`` now and watch it from there; ``False`` if the stream was rebuilt meanwhile."""
        read = self._client.read_ranges([rng.read()], "reading the rendezvous keys")
        with self.cond:
            if generation != self._generation or self._ranges.get(rng.name) is not rng:
                return False
            forged = self._apply_reads([rng], read)
        self._purge(forged)
        return True

    def _apply_read(self, rng: Range, revision: int, kvs: list[Any], fresh: bool) -> list[tuple[bytes, bytes]]:
        """Take a read of ``rng`` at ``revision`` (``cond`` held); the forged values it holds.

        Unless it is a rebuild's ``fresh`` first read (taken as it is, even from an etcd restored to an older
        revision), a read older than what the range reflects (a newer read, or events, came first) is dropped.
        """
        if not fresh and revision < rng.revision:
            return []
        forged = [(kv.key, kv.value) for kv in kvs if rng.kind != DELETES and self._forgery(kv.key, kv.value)]
        refused = {key for key, _ in forged}
        kept = [kv for kv in kvs if kv.key not in refused]
        if rng.kind == FULL:
            self._forget(rng)
            self._entries.update({kv.key: Entry(kv.value, kv.create_revision, kv.mod_revision) for kv in kept})
        rng.take_read(revision, kept, fresh)
        self._revision = max(self._revision, revision)
        self.deletions += 1
        return forged

    # -- the stream ------------------------------------------------------------------------------
    def _resync(self, confirm: bool = False) -> None:
        for _ in range(_COMPACTED_RETRIES):
            try:
                return self._resync_once(confirm)
            except WatchCompactedError:  # compacted between the read and the watch: read again
                continue
        raise EtcdError("etcd compacted the rendezvous keys' history faster than they could be watched.")

    def _resync_once(self, confirm: bool) -> None:
        """Read every range at one revision, then watch them all from there on a new stream (and, to ``confirm``,
        read them once more after etcd confirmed the watches: :meth:`_read_confirmed`)."""
        with self.cond:
            if self._stopped:
                return
            self._generation += 1
            generation = self._generation
            old, self._stream = self._stream, None
            ranges = [r for r in self._ranges.values() if not r.done]
        if old is not None:
            old.close()
        read = self._client.read_ranges([r.read() for r in ranges], "reading the rendezvous keys")
        with self.cond:
            if self._stopped or generation != self._generation:
                return
            forged = self._apply_reads(ranges, read, fresh=True)
            ranges = [r for r in ranges if self._ranges.get(r.name) is r]
        stream = self._client.open_watch_stream(
            [(r, self._spec(r)) for r in ranges],
            lambda rng, response: self._on_response(generation, cast(Range, rng), response),
            lambda error: self._on_end(generation, error),
            "watching the rendezvous keys",
            self.received,
        )
        with self.cond:
            current = not self._stopped and generation == self._generation
            lost = current and self._lost_while_opening == generation
            if current:
                self._stream = stream
                for rng in self._ranges.values():  # added while the stream was opened
                    if rng not in ranges and not rng.done:
                        stream.create(rng, self._spec(rng))
                for rng in ranges:  # removed while it was opened
                    if self._ranges.get(rng.name) is not rng:
                        stream.cancel(rng)
        if not current:
            stream.close()
        elif confirm:
            forged += self._read_confirmed(generation)
        self._purge(forged)
        if lost:
            log.info("The rendezvous watch ended while it was opened; reading the keys again.")
            self._rebuild(generation)

    def _read_confirmed(self, generation: int) -> list[tuple[bytes, bytes]]:
        """Read the watched ranges again now that etcd confirmed their watches; the forged values read.

        etcd before 3.5.16 (etcd-io/etcd#18089) drops a deletion from a watch that starts at the revision a
        compaction was made at, if that revision is the deletion and the compaction came first; no refusal comes
        either. This read sees every deletion up to it; the watch brings the later ones. Events that come while it
        is under way wait for it (:meth:`_hold`), so it never lands on a newer copy. A first start does without.
        """
        with self.cond:
            ranges = self._hold(generation)
        try:
            read = self._client.read_ranges([r.read() for r in ranges], "reading the rendezvous keys")
        except BaseException:
            with self.cond:
                self._release(generation, ranges, None)
            raise
        with self.cond:
            return self._release(generation, ranges, read)

    def _hold(self, generation: int) -> list[Range]:
        """Keep the events of ``generation`` until :meth:`_release` (``cond`` held); the ranges to read."""
        self._held = (generation, [])
        return [r for r in self._ranges.values() if not r.done]

    def _release(
        self, generation: int, ranges: list[Range], read: tuple[int, list[list[Any]]] | None
    ) -> list[tuple[bytes, bytes]]:
        """Take ``read`` (of ``ranges``, made after :meth:`_hold`), then the events held since, in the order they
        came (those the read holds already are skipped); ``cond`` held. The forged values read."""
        held: list[tuple[Range, Any]] = []
        if self._held is not None and self._held[0] == generation:  # (else a newer rebuild holds its own)
            held, self._held = self._held[1], None
        forged = self._apply_reads(ranges, read) if read is not None and generation == self._generation else []
        for rng, response in held:
            self._on_response(generation, rng, response)
        return forged

    def _apply_reads(
        self, ranges: list[Range], read: tuple[int, list[list[Any]]], fresh: bool = False
    ) -> list[tuple[bytes, bytes]]:
        """Take one read of ``ranges`` at one revision, those still watched (``cond`` held); the forged values."""
        revision, reads = read
        forged: list[tuple[bytes, bytes]] = []
        if self._stopped:
            return forged
        for rng, kvs in zip(ranges, reads, strict=True):
            if self._ranges.get(rng.name) is rng and not rng.done:
                forged += self._apply_read(rng, revision, kvs, fresh)
        self.cond.notify_all()
        self.major_cond.notify_all()
        return forged

    def _rebuild(self, generation: int) -> None:
        """Rebuild the stream of ``generation`` (once), on a thread of its own."""
        with self.cond:
            if self._stopped or generation != self._generation or self._recovering == generation:
                return
            self._recovering = generation
        threading.Thread(target=self._recover, name="etcd3-rdzv-resync", daemon=True).start()

    def _opened(self, generation: int) -> bool:
        """Whether the stream of ``generation`` is kept already (``cond`` held); if it is still opening, note that
        it was lost: the opening rebuilds it once it keeps it. etcd may end a watch right after confirming it (a
        compaction while the new watch still catches up), before the opening thread has kept the stream."""
        if self._stream is None and generation == self._generation:
            self._lost_while_opening = generation
        return self._stream is not None

    def _on_end(self, generation: int, error: BaseException | None) -> None:
        """The stream ended (an error, or ``None`` when closed here): rebuild unless stopped or superseded."""
        with self.cond:
            if error is None or self._stopped or generation != self._generation or not self._opened(generation):
                return  # closed here, stopped, superseded, or still opening (the opening rebuilds it)
        log.info("The rendezvous watch broke (%s); reading the keys again.", error)
        self._rebuild(generation)

    def _on_response(self, generation: int, rng: Range, response: Any) -> None:
        if response.canceled:  # etcd refused or ended this watch (its history compacted away): read afresh
            with self.cond:
                opened = self._opened(generation)
            if opened:  # (while the stream opens: a refusal raises there, a later end is rebuilt once kept)
                log.info("etcd ended the rendezvous watch on %s (%s); reading the keys again.",
                         rng.key.decode(errors="replace"), response.cancel_reason or "compacted")  # fmt: skip
                self._rebuild(generation)
            return
        forged: list[tuple[bytes, bytes]] = []
        with self.cond:
            if self._held is not None and self._held[0] == generation:  # its read is under way: after it
                self._held[1].append((rng, response))
                return
            if generation != self._generation or self._ranges.get(rng.name) is not rng or rng.done:
                return
            major = False
            for event in response.events:
                deleted = event.type == _DELETE
                kv = event.kv
                if kv.mod_revision < rng.start:  # the range's latest read holds it already
                    continue
                refused = not deleted and self._forgery(kv.key, kv.value) is not None
                if refused:
                    forged.append((kv.key, kv.value))
                major = self._take(rng, kv, deleted, refused) or major
            rng.revision = max(rng.revision, int(response.header.revision))
            self._revision = max(self._revision, int(response.header.revision))
            if rng.until is not None and rng.until(rng):
                self._finish(rng)
            self.cond.notify_all()
            if major:
                self.major_cond.notify_all()
        self._purge(forged)

    def _take(self, rng: Range, kv: Any, deleted: bool, refused: bool) -> bool:
        """Apply one event to ``rng`` (``cond`` held); whether it matters to a waiter on ``major_cond``."""
        key = kv.key
        if rng.kind == FULL:
            if deleted or refused:  # a forged value counts as no value
                if self._entries.pop(key, None) is not None or deleted:
                    self.deletions += 1
                    return True
                return False
            self._entries[key] = Entry(kv.value, kv.create_revision, kv.mod_revision)
            return self._major(key)
        changed = not refused and rng.take_event(kv, deleted)
        if changed and deleted:
            self.deletions += 1
        return changed

    def _recover(self) -> None:
        try:
            self._resync(confirm=True)
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

    # -- forged values -------------------------------------------------------------------------
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
