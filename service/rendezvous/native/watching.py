"""What a native node watches, by its part in the round, so that a join costs every other node no watch event.

* Always: ``closed`` and the seals (``sealed/``): one event per round, the seal.
* From its join of round ``r``: the deletions in round ``r`` only (etcd drops the puts before sending), from
  the revision after its join: its own key going, a node ahead of it leaving. Nobody else's join reaches it.
* As one of the round's first ``SEALERS`` joiners: every key under ``rounds/`` with values, read once and then
  watched, to decide the seal (``rounds.py``). A node that a deletion moves among the first reads and watches
  them from then on.
* As a member of the sealed round ``r``: its round's deletions until the first departure of another node,
  and the puts into later rounds (a node waiting) until the first; each then stops, since the answer to
  ``num_nodes_waiting`` can only stay positive and the node restarts. The other members' moves into the next
  round reach it no more. The seal lists no members: any key of round ``r`` but its own deleted after the
  sealer's decision (the seal's ``decided_at``) is a departure (a key that is not a member's can only be a
  joiner the seal left out, moving on to round ``r + 1``, which makes a node waiting anyway). After a re-read
  of the round (a rebuilt stream), the members still there are its keys created at or before the seal's
  ``cutoff``: the others of the seal's ``world`` left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.rendezvous.client import EtcdError, prefix_end
from service.rendezvous.native.errors import connection_error
from service.rendezvous.native.mirror import Mirror
from service.rendezvous.native.ranges import FULL, Range
from service.rendezvous.native.records import Layout, NodeRecord, SealRecord
from service.rendezvous.native.rounds import among_sealers
from service.rendezvous.requests import DELETES, PUTS

if TYPE_CHECKING:
    from service.rendezvous.parts import Etcd3Parts

CLOSED, SEALS, ROUND, ROUNDS, LATER = "closed", "seals", "round", "rounds", "later"


class RoundWatches:
    """The part of NativeRendezvousHandler that picks its watches. NativeRendezvousHandler sets these."""

    _joined_at: int
    _key: bytes | None
    _layout: Layout
    _sealed: SealRecord | None  # the seal of the round it is a member of
    _seal_revision: int  # the revision that seal was written at
    _mirror: Mirror
    _node: str
    _parts: Etcd3Parts
    _round: int | None
    _sealer: bool

    def _control_ranges(self) -> list[Range]:
        layout = self._layout
        return [Range(CLOSED, layout.closed, None, FULL), Range(SEALS, layout.seals, prefix_end(layout.seals), FULL)]

    def _watch_round(self, round_no: int) -> None:
        """Joined ``round_no`` at ``_joined_at``: watch its deletions from then on, and all of it as a sealer."""
        prefix = self._layout.round_prefix(round_no)
        self._add(Range(ROUND, prefix, prefix_end(prefix), DELETES, start=self._joined_at + 1))
        if self._sealer:
            self._add(Range(ROUNDS, self._layout.rounds, prefix_end(self._layout.rounds), FULL))

    def _promote_if_first(self, round_no: int) -> None:
        """A key of its round went: this node may now be among the first joiners, and then watches them all."""
        assert self._key is not None
        try:
            sealer = among_sealers(self._parts.client, self._layout, round_no, self._key, None)
        except EtcdError as exc:
            raise connection_error(exc) from exc
        if sealer:
            self._sealer = True
            self._add(Range(ROUNDS, self._layout.rounds, prefix_end(self._layout.rounds), FULL))

    def _watch_as_member(self, round_no: int, seal_revision: int) -> None:
        """A member of sealed round ``round_no``: watch for the first departure and the first node waiting."""
        self._sealer = False
        self._mirror.remove(ROUNDS)
        self._mirror.set_until(ROUND, lambda rng: self._departed(rng) > 0)
        later = self._layout.round_prefix(round_no + 1)
        self._add(Range(LATER, later, prefix_end(self._layout.rounds), PUTS, start=seal_revision + 1,
                        until=lambda rng: bool(rng.put)))  # fmt: skip

    def _drop_round_watches(self) -> None:
        for name in (ROUND, ROUNDS, LATER):
            self._mirror.remove(name)

    def _add(self, rng: Range) -> None:
        try:
            self._mirror.add(rng)
        except EtcdError as exc:
            raise connection_error(exc) from exc

    # -- what the watches say (``cond`` held) ----------------------------------------------------
    def _own_key_gone(self) -> bool:
        """Whether this node's key in its round was deleted since it joined."""
        rng = self._mirror.range(ROUND)
        return self._key is None or (rng is not None and rng.gone(self._key))

    def _waiting_and_departed(self) -> int:
        """As a member: nodes waiting in later rounds, plus members of its round that left (each until the first)."""
        assert self._round is not None
        later, own = self._mirror.range(LATER), self._mirror.range(ROUND)
        waiting = 0
        for key, entry in (later.put if later is not None else {}).items():
            self._layout.decode(NodeRecord, entry.value, key)  # a planted value is refused, not counted
            waiting += 1
        return waiting + (self._departed(own) if own is not None else 0)

    def _departed(self, rng: Range) -> int:
        """How many nodes left its round (``rng``, the round's deletions) since the sealer decided its members
        (the seal's ``decided_at``: a member that went between the decision and the seal counts too)."""
        seal = self._sealed
        if seal is None:
            return 0
        if rng.present is not None and rng.read_at > seal.decided_at:  # re-read after the decision: exact
            return seal.world - sum(1 for created in rng.present.values() if created <= seal.cutoff)
        return sum(1 for key, at in rng.deleted.items() if key != self._key and at > seal.decided_at)

    def _saw_since(self, round_no: int, revision: int) -> bool:
        """Whether the copy of the round moved past ``revision``, or the round was sealed or closed (``cond`` held)."""
        rounds, entries = self._mirror.range(ROUNDS), self._mirror.items()
        return (
            rounds is None
            or rounds.revision > revision
            or self._mirror.error is not None
            or self._layout.seal_key(round_no) in entries
            or self._layout.closed in entries
        )
