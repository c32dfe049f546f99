"""What the rendezvous mirror (``mirror.py``) keeps of one watched range: its keys, and what its watch told so far.

Each :class:`Range` is one of:

* ``FULL``: every key of the range with its value (the mirror keeps them, in :meth:`Mirror.items`);
* ``DELETES``: only deletions (etcd filters the puts out before sending): the keys deleted since the range
  began (with the revision of each deletion), and after a re-read the keys present in it (with the revision
  each was created at) and those absent from it (:meth:`Range.gone`);
* ``PUTS``: only puts: the keys written since the range began, with their values.

A range may stop its watch itself (``until``) once its answer cannot change any more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.rendezvous.requests import ALL, DELETES, PUTS, RangeRead

FULL = ALL
_LATER_LIMIT = 64  # a re-read of a PUTS range keeps this many of its keys: enough to know someone waits


@dataclass(frozen=True)
class Entry:
    """One key as last seen: value and revisions (create_revision orders joins)."""

    value: bytes
    create_revision: int
    mod_revision: int


@dataclass(eq=False)
class Range:
    """One watched range (``end`` ``None``: the one key ``key``) and what its watch told so far."""

    name: str
    key: bytes
    end: bytes | None
    kind: str  # FULL, DELETES or PUTS
    start: int = 0  # the first revision its copy lacks: a watch starts there, older events are in it (0: read it first)
    until: Callable[[Range], bool] | None = None  # stop watching once this holds
    deleted: dict[bytes, int] = field(default_factory=dict)  # DELETES: keys deleted since it began (or its re-read),
    # each with the revision it was deleted at
    present: dict[bytes, int] | None = None  # DELETES: the keys of its last re-read (each with its create_revision),
    # less those deleted since
    read_at: int = 0  # DELETES: the revision of its last re-read (0: none)
    put: dict[bytes, Entry] = field(default_factory=dict)  # PUTS: keys written since it began
    revision: int = 0  # the newest revision its copy reflects
    done: bool = False  # ``until`` held: its watch is cancelled

    def covers(self, key: bytes) -> bool:
        if self.end is None:
            return key == self.key
        return key >= self.key and (self.end == b"\0" or key < self.end)

    def gone(self, key: bytes) -> bool:
        """DELETES: whether ``key`` was deleted since the range began (or was absent from its re-read)."""
        return key in self.deleted or (self.present is not None and key not in self.present)

    def read(self) -> RangeRead:
        """How a re-read fetches it: values, keys only for DELETES, the first few for PUTS."""
        return RangeRead(
            self.key, self.end, keys_only=self.kind == DELETES, limit=_LATER_LIMIT if self.kind == PUTS else 0
        )

    def take_read(self, revision: int, kvs: list[Any], fresh: bool) -> None:
        """A read at ``revision`` (forged values left out; a rebuild's first is ``fresh``: what the range reflects
        from now on, even if etcd came back older); a FULL range's keys are the mirror's to keep."""
        if self.kind == DELETES:
            self.present, self.deleted = {kv.key: int(kv.create_revision) for kv in kvs}, {}
            self.read_at = revision
        elif self.kind == PUTS:
            self.put.update({kv.key: Entry(kv.value, kv.create_revision, kv.mod_revision) for kv in kvs})
        self.start = revision + 1
        self.revision = revision if fresh else max(self.revision, revision)

    def take_event(self, kv: Any, deleted: bool) -> bool:
        """One event (not forged) of a DELETES or PUTS range; whether it changed the range's answer."""
        if self.kind == DELETES and deleted:
            self.deleted[kv.key] = int(kv.mod_revision)
            if self.present is not None:
                self.present.pop(kv.key, None)
            return True
        if self.kind == PUTS and not deleted:
            self.put[kv.key] = Entry(kv.value, kv.create_revision, kv.mod_revision)
            return True
        return False
