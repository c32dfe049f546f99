"""What a native node watches, by its part in the round, so that a join costs every other node no watch event and
etcd no work per waiting node.

* Always: ``closed`` and the seals (``sealed/``): one event per round, the seal.
* From its join of round ``r`` until the seal: its own key's deletion, and the round's seats
  (``seats/<r>/``, ``rounds.SEALERS`` keys): nobody else's join reaches it, and etcd matches a join against
  the seats' few watchers only, not against every node waiting (a watch of the round's prefix, even one that
  passes on deletions only, is matched by etcd against every put into the round: O(N) per join).
* With a seat (one of the round's first joiners, or a node that took a seat its holder left): every key under
  ``rounds/`` with values, read once and then watched, to decide the seal (``rounds.py``). A node without a
  seat that sees one free takes it (``rounds.try_take_seat``).
* As a member of the sealed round ``r``: its round's deletions from the sealer's decision on (the seal's
  ``decided_at``: etcd replays them from its history) until the first departure of another node, and the puts
  into later rounds (a node waiting) until the first; each then stops, since the answer to
  ``num_nodes_waiting`` can only stay positive and the node restarts. The other members' moves into the next
  round reach it no more. The seal lists no members: any key of round ``r`` but its own deleted after the
  sealer's decision is a departure (a key that is not a member's can only be a joiner the seal left out,
  moving on to round ``r + 1``, which makes a node waiting anyway). After a re-read of the round (a rebuilt
  stream, or a history etcd compacted), the members still there are its keys created at or before the seal's
  ``cutoff``: the others of the seal's ``world`` left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from service.rendezvous.client import EtcdError, prefix_end
from service.rendezvous.native.errors import connection_error
from service.rendezvous.native.mirror import Mirror
from service.rendezvous.native.ranges import FULL, Range
from service.rendezvous.native.records import Layout, NodeRecord, SealRecord
from service.rendezvous.native.rounds import SEALERS, try_take_seat
from service.rendezvous.requests import DELETES, PUTS

if TYPE_CHECKING:
    from service.rendezvous.lease import NodeLease
    from service.rendezvous.parts import Etcd3Parts

CLOSED, SEALS, OWN, ROUND, ROUNDS, SEATS, LATER = "closed", "seals", "own", "round", "rounds", "seats", "later"


class RoundWatches:
    """The part of NativeRendezvousHandler that picks its watches. NativeRendezvousHandler sets these."""

    _joined_at: int
    _key: bytes | None
    _layout: Layout
    _sealed: SealRecord | None  # the seal of the round it is a member of
    _seal_revision: int  # the revision that seal was written at
    _lease: NodeLease
    _mirror: Mirror
    _node: str
    _parts: Etcd3Parts
    _record: Callable[[int], NodeRecord]  # this node's record in a round
    _round: int | None
    _sealer: bool

    def _control_ranges(self) -> list[Range]:
        layout = self._layout
        return [Range(CLOSED, layout.closed, None, FULL), Range(SEALS, layout.seals, prefix_end(layout.seals), FULL)]

    def _watch_round(self, round_no: int) -> None:
        """Joined ``round_no`` at ``_joined_at``: watch its own key's deletion and the seats, and all of the round
        with a seat."""
        assert self._key is not None
        self._add(Range(OWN, self._key, None, DELETES, start=self._joined_at + 1))
        seats = self._layout.seats_of_round(round_no)  # all taken at its join, or it took one
        self._add(Range(SEATS, seats, prefix_end(seats), DELETES, start=self._joined_at + 1))
        if self._sealer:
            self._add(Range(ROUNDS, self._layout.rounds, prefix_end(self._layout.rounds), FULL))

    def _seat_free(self, round_no: int, tried: int) -> int:
        """Whether a seat of ``round_no`` came free since its join (``cond`` held): the revision that shows it, if
        newer than ``tried`` (the one its last try answered), else 0. Every seat was taken when it joined (else its
        join took one), so a seat is free once a seat key is deleted: its holder died, or a forged value in it was
        deleted; after a re-read, while the seats present are fewer than ``SEALERS``. A try another node won
        waits for the next deletion."""
        rng = self._mirror.range(SEATS)
        if self._sealer or rng is None:
            return 0
        if rng.present is not None:  # re-read (a rebuilt stream), then events
            newest = max([rng.read_at, *rng.deleted.values()]) if len(rng.present) < SEALERS else 0
        else:
            newest = max(rng.deleted.values(), default=0)
        return newest if newest > tried else 0

    def _take_seat(self, round_no: int) -> None:
        """A seat of its round is free: take it (if another node does not first), and then watch all the round."""
        record = self._record(round_no)
        try:
            seat = try_take_seat(self._parts.client, self._layout, round_no, record, self._lease.grant())
        except EtcdError as exc:
            raise connection_error(exc) from exc
        if seat >= 0:
            self._sealer = True
            self._add(Range(ROUNDS, self._layout.rounds, prefix_end(self._layout.rounds), FULL))

    def _watch_as_member(self, round_no: int, seal: SealRecord, seal_revision: int) -> None:
        """A member of sealed ``round_no``: watch for the first departure since the sealer's decision, and the first
        node waiting."""
        self._sealer = False
        self._mirror.remove(ROUNDS)  # its own key's and the seats' watches stay until its next join: no event
        prefix = self._layout.round_prefix(round_no)
        self._add(Range(ROUND, prefix, prefix_end(prefix), DELETES, start=seal.decided_at + 1,
                        until=lambda rng: self._departed(rng) > 0))  # fmt: skip
        later = self._layout.round_prefix(round_no + 1)
        self._add(Range(LATER, later, prefix_end(self._layout.rounds), PUTS, start=seal_revision + 1,
                        until=lambda rng: bool(rng.put)))  # fmt: skip

    def _drop_round_watches(self) -> None:
        for name in (OWN, ROUND, ROUNDS, SEATS, LATER):
            self._mirror.remove(name)

    def _add(self, rng: Range) -> None:
        try:
            self._mirror.add(rng)
        except EtcdError as exc:
            raise connection_error(exc) from exc

    # -- what the watches say (``cond`` held) ----------------------------------------------------
    def _own_key_gone(self) -> bool:
        """Whether this node's key in its round was deleted since it joined."""
        rng = self._mirror.range(OWN)
        return self._key is None or (rng is not None and rng.gone(self._key))

    def _waiting_and_departed(self) -> int:
        """As a member: nodes waiting in later rounds, plus members of its round that left (each until the first)."""
        assert self._round is not None
        later, members = self._mirror.range(LATER), self._mirror.range(ROUND)
        waiting = 0
        for key, entry in (later.put if later is not None else {}).items():
            self._layout.decode(NodeRecord, entry.value, key)  # a planted value is refused, not counted
            waiting += 1
        return waiting + (self._departed(members) if members is not None else 0)

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
