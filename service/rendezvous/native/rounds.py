"""The rules of the native rendezvous: what a round looks like, when it may be sealed, and the two writes.

A node joins round ``t`` (the round after the newest sealed one) with one
transaction that writes its :class:`NodeRecord` on its own lease, and only if
``t`` is not sealed yet and the run is not closed; the same transaction takes
one of the round's ``SEALERS`` seats if one is free (a key per seat, on the
node's lease), and a node with a seat watches the whole round and may seal
it. The first ``SEALERS`` joiners take the seats; a seat whose holder dies
goes with its lease, and a waiting node takes it. Nobody else watches the
round's keys before the seal, so a join costs etcd no work per waiting node.
Round ``t`` is sealed by one transaction that writes its :class:`SealRecord`
only if

* nobody sealed ``t`` before (``create_revision`` of the seal key is 0),
* the run is not closed,
* no node key of round ``t`` changed after the revision the sealer decided on
  (a joiner that arrived meanwhile makes the seal fail, and the sealer decides
  again with it included), and
* no node key is left in an earlier round: every member of the previous round
  has either moved on to ``t`` or died (its key went with its lease).

Members are the first ``max_nodes`` joiners in ``create_revision`` order:
the seal names only their number (``world``) and the join revision of the
last one (``cutoff``), so it costs every node the same few bytes whatever the
size of the round. Ranks follow the node ids (which start with the node's
address), as torch's own handler sorts its participants; the sealer writes
each member's rank to a key of its own, ``ranks/<r>/<sealer>/<node>``, in
transactions of at most ``RANKS_PER_TXN`` puts, the last one together with the
seal and every one under the seal's conditions, and each member reads its own
key once (:func:`read_rank`). The sealer's id in the key keeps two racing
sealers' ranks apart: a member reads those of the seal's ``sealed_by``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from pyetcd import etcdrpc

from service.rendezvous.client import EtcdClient, EtcdError, prefix_end
from service.rendezvous.native.ranges import Entry
from service.rendezvous.native.records import Layout, NodeRecord, RankRecord, RecordError, SealRecord
from service.rendezvous.requests import RangeRead, delete_op, put_op, txn_request

log = logging.getLogger(__name__)
_PURGES = 5  # joins refused by forged values (each then deleted) before giving up
# The holders of a round's seats (its first joiners, or who took a seat that came free) watch all its keys and
# may seal it: the first joiner seals, the others step in if it has not one liveness timeout later. Every other
# node watches only its own key, the seats and the seals, so a join costs it no event and etcd no match.
SEALERS = 3
# etcd refuses a transaction of more than --max-txn-ops operations (128 by default): a seal writes its ranks in
# transactions of at most this many operations each.
RANKS_PER_TXN = 100


@dataclass(frozen=True)
class Joiner:
    """A node key of one round: join order, node id and where the node is."""

    create_revision: int
    node: str
    addr: str
    member_of: int = -1  # the round it was a member of when it joined this one (-1: none)


@dataclass(frozen=True)
class RoundView:
    """What a node's copy of the keys says about round ``round``."""

    round: int
    joined: tuple[Joiner, ...]  # in join order
    earlier: int  # node keys still in rounds before ``round``
    seal: SealRecord | None
    seal_created: int  # create_revision of the seal key (0: none)
    closed: bool

    @property
    def drained(self) -> bool:
        """Every member of the previous round has moved on or died."""
        return self.earlier == 0

    def members(self, max_nodes: int) -> tuple[Joiner, ...]:
        return self.joined[:max_nodes]


def latest_sealed(layout: Layout, entries: dict[bytes, Entry]) -> int | None:
    """The newest sealed round in ``entries``, or ``None``."""
    rounds = [r for r in (layout.parse_seal_key(k) for k in entries) if r is not None]
    return max(rounds) if rounds else None


def view_round(layout: Layout, entries: dict[bytes, Entry], round_no: int) -> RoundView:
    """Round ``round_no`` as ``entries`` show it; raises ``RecordError`` for a value this backend did not write."""
    joined: list[Joiner] = []
    earlier = 0
    for key, entry in entries.items():
        parsed = layout.parse_node_key(key)
        if parsed is None:
            continue
        r, node = parsed
        if r < round_no:
            earlier += 1
        elif r == round_no:
            record = layout.decode(NodeRecord, entry.value, key)
            joined.append(Joiner(entry.create_revision, node, record.addr, record.member_of))
    joined.sort(key=lambda j: (j.create_revision, j.node))
    seal_entry = entries.get(layout.seal_key(round_no))
    seal = None if seal_entry is None else layout.decode(SealRecord, seal_entry.value, layout.seal_key(round_no))
    return RoundView(
        round=round_no,
        joined=tuple(joined),
        earlier=earlier,
        seal=seal,
        seal_created=0 if seal_entry is None else seal_entry.create_revision,
        closed=layout.closed in entries,
    )


def seal_due(view: RoundView, min_nodes: int, max_nodes: int) -> str | None:
    """When round ``view.round`` may be sealed: ``"now"``, ``"last_call"`` (after the last call), or ``None``.

    Full (``max_nodes`` joined): now. A re-formed world (at least one member of
    the previous round is back, as its ``member_of`` says, and every other one has moved on or died): now,
    since every node known to be alive is in and nobody else is known to come.
    Otherwise, with ``min_nodes`` in: after the last call.
    """
    if view.seal is not None or view.closed or not view.drained or len(view.joined) < min_nodes:
        return None
    if len(view.joined) >= max_nodes:
        return "now"
    if view.round > 0 and any(j.member_of == view.round - 1 for j in view.joined):
        return "now"
    return "last_call"


class Joined(NamedTuple):
    """What a join transaction found: the revision of its write (0: refused), the sealer's seat it took (-1: none),
    the round's seal if it was sealed first, the closed record if closed."""

    revision: int
    seat: int
    seal: bytes | None
    closed: bytes | None
    seal_revision: int = 0  # the revision the seal was written at

    @property
    def sealer(self) -> bool:
        return self.seat >= 0


def seat_claim(client: EtcdClient, layout: Layout, round_no: int, record: NodeRecord, lease_id: int) -> Any:
    """A nested transaction that takes the round's first free seat (``layout.seat_key``), if any: seat 0 if nobody
    holds it, else seat 1, ..., on this node's lease, so a seat frees itself when its holder dies. On a signed run,
    with every seat taken it reads them: a forged one must not keep a seat from the run's nodes."""
    tx = client.raw.transactions
    seats = layout.seats_of_round(round_no)
    claim = RangeRead(seats, prefix_end(seats)).op() if layout.secret is not None else None
    for seat in reversed(range(SEALERS)):
        key = layout.seat_key(round_no, seat)
        claim = etcdrpc.RequestOp(request_txn=txn_request(
            [tx.create(key) == 0], [put_op(key, layout.encode(key, record), lease_id)], [claim] if claim else []
        ))  # fmt: skip
    return claim


def seat_taken(response: Any) -> int:
    """The seat a :func:`seat_claim` took (its response), or -1."""
    for seat in range(SEALERS):
        if response.succeeded:
            return seat
        if not response.responses:
            break
        response = response.responses[0].response_txn
    return -1


def _seats_read(response: Any) -> list[Any]:
    """The seats a signed run's :func:`seat_claim` read when it found every one taken (its response)."""
    for _ in range(SEALERS - 1):
        response = response.responses[0].response_txn
    return list(response.responses[0].response_range.kvs) if response.responses else []


def try_join(
    client: EtcdClient, layout: Layout, round_no: int, record: NodeRecord, lease_id: int, leave: bytes | None
) -> Joined:
    """Write this node's key into ``round_no`` (deleting ``leave``, its key of an earlier round) in one transaction,
    which also takes a free sealer's seat of the round (:func:`seat_claim`): the first ``SEALERS`` joiners seal.

    On a signed run, a forged seal or ``closed`` that refused the write is deleted and the join tried again
    (``EtcdError`` if someone keeps writing them).
    """
    tx = client.raw.transactions
    key, seal_key = layout.node_key(round_no, record.node), layout.seal_key(round_no)
    success = [put_op(key, layout.encode(key, record), lease_id),
               seat_claim(client, layout, round_no, record, lease_id)]  # fmt: skip
    if leave is not None and leave != key:
        success.insert(0, delete_op(leave))
    request = txn_request(
        [tx.create(seal_key) == 0, tx.version(layout.closed) == 0],
        success,
        [RangeRead(seal_key).op(), RangeRead(layout.closed).op()],
    )
    for _ in range(_PURGES):
        response = client.txn(request, "joining the rendezvous round")
        if response.succeeded:
            seat = seat_taken(response.responses[-1].response_txn)
            if seat < 0 and layout.secret is not None:  # its seat watch sees the deletion, and it takes the seat
                for kv in _seats_read(response.responses[-1].response_txn):
                    delete_forged(client, layout, kv.key, kv.value)
            return Joined(int(response.header.revision), seat, None, None)
        seals, closes = (r.response_range.kvs for r in response.responses)
        seal, closed = _value(seals), _value(closes)
        if not (delete_forged(client, layout, layout.closed, closed) or delete_forged(client, layout, seal_key, seal)):
            return Joined(0, -1, seal, closed, int(seals[0].mod_revision) if seals else 0)
    raise EtcdError(
        f"Joining round {round_no} was refused {_PURGES} times by values that no agent of this signed run wrote; "
        "someone keeps writing them under the run's prefix. Restrict it with etcd's authentication."
    )


def try_take_seat(client: EtcdClient, layout: Layout, round_no: int, record: NodeRecord, lease_id: int) -> int:
    """A seat of unsealed ``round_no`` came free (its holder died, or a forged value in it was deleted): take it
    while this node's key is still in the round; the seat taken, or -1 (taken by another, or sealed meanwhile)."""
    tx = client.raw.transactions
    key = layout.node_key(round_no, record.node)
    request = txn_request([tx.version(key) > 0, tx.create(layout.seal_key(round_no)) == 0],
                          [seat_claim(client, layout, round_no, record, lease_id)])  # fmt: skip
    response = client.txn(request, "taking a sealer's seat")
    return seat_taken(response.responses[0].response_txn) if response.succeeded else -1


def _value(kvs: Any) -> bytes | None:
    return bytes(kvs[0].value) if kvs else None


def try_seal(
    client: EtcdClient, layout: Layout, view: RoundView, decided_at: int, max_nodes: int, sealer: str, lease_id: int
) -> bool:
    """Seal ``view.round`` with its first ``max_nodes`` joiners, if nothing changed after revision ``decided_at``.

    Every member's rank goes to its own key; all but the last ``RANKS_PER_TXN``-sized chunk in transactions of
    their own, the last one with the seal. Each transaction holds only under the seal's conditions, so a round
    that changed, or another sealer's seal, makes this try fail (``False``), whichever chunk it reaches.
    """
    tx = client.raw.transactions
    joined = view.members(max_nodes)
    # Ranks: by node id (address first), as torch's own handler sorts them.
    members = sorted(joined, key=lambda j: j.node)
    world = len(members)
    cutoff = joined[-1].create_revision
    record = SealRecord(round=view.round, world=world, cutoff=cutoff, sealed_by=sealer, sealed_at=time.time(),
                        decided_at=decided_at)  # fmt: skip
    round_prefix = layout.round_prefix(view.round)
    seal_key = layout.seal_key(view.round)
    compare = [
        tx.create(seal_key) == 0,
        tx.version(layout.closed) == 0,
        tx.mod(round_prefix, range_end=prefix_end(round_prefix)) < decided_at + 1,
        tx.version(layout.rounds, range_end=round_prefix) == 0,
    ]
    ranks = []
    for rank, member in enumerate(members):
        key = layout.rank_key(view.round, sealer, member.node)
        value = RankRecord(round=view.round, rank=rank, world=world, cutoff=cutoff, sealed_by=sealer)
        ranks.append(put_op(key, layout.encode(key, value), lease_id))
    last = [put_op(seal_key, layout.encode(seal_key, record), lease_id)]
    if view.round >= 2:  # seals and ranks older than the previous round are no longer read by anyone
        last.append(delete_op(layout.seals, layout.seal_key(view.round - 1)))
        last.append(delete_op(layout.ranks, layout.ranks_of_round(view.round - 1)))
    if view.round >= 1:  # nor are the seats of earlier rounds (this round's: until its members' seal is seen)
        last.append(delete_op(layout.seats, layout.seats_of_round(view.round)))
    for chunk in seal_chunks(ranks, last):
        if not client.txn(txn_request(compare, chunk), "sealing the rendezvous round").succeeded:
            return False
    return True


def seal_chunks(ranks: list[Any], last: list[Any]) -> list[list[Any]]:
    """The operations of a seal in transactions of at most ``RANKS_PER_TXN``: the rank puts in order, the last
    chunk holding what is left of them together with ``last`` (the seal's own operations)."""
    split = max(0, len(ranks) - (RANKS_PER_TXN - len(last)))
    chunks = [ranks[i : min(i + RANKS_PER_TXN, split)] for i in range(0, split, RANKS_PER_TXN)]
    return [*chunks, ranks[split:] + last]


def read_rank(client: EtcdClient, layout: Layout, round_no: int, seal: SealRecord, node: str) -> int | None:
    """``node``'s rank in sealed round ``round_no``, from one read of its own rank key; ``None``: not a member.

    A rank of another world or cutoff than the seal's is a leftover of a failed try of the same sealer (some of
    its chunks landed): not a member either. On a signed run a forged value there is ignored (as if absent) and
    deleted; on an unsigned one a value this backend did not write, or a rank outside the seal's world, raises
    ``RecordError`` naming the key.
    """
    key = layout.rank_key(round_no, seal.sealed_by, node)
    _, [kvs] = client.read_ranges([RangeRead(key)], "reading this node's rank")
    value = _value(kvs)
    if value is None or delete_forged(client, layout, key, value):
        return None
    record = layout.decode(RankRecord, value, key)
    if (record.round, record.world, record.cutoff, record.sealed_by) != (round_no, seal.world, seal.cutoff,
                                                                       seal.sealed_by):  # fmt: skip
        # Left by a try of the same sealer that failed after some of its chunks had landed, for a member set that
        # differs from the seal's (a world and cutoff name one set): this node is not in the sealed one.
        return None
    if not 0 <= record.rank < seal.world:
        raise RecordError(
            f"The rendezvous key {key.decode(errors='replace')} holds rank {record.rank}, outside round "
            f"{round_no}'s world of {seal.world}: something else writes under the run's prefix; restrict it with "
            "etcd's authentication, or use another --rdzv-id."
        )
    return record.rank


def delete_forged(client: EtcdClient, layout: Layout, key: bytes, value: bytes | None) -> bool:
    """Whether ``value`` (read under ``key``) is forged: on a signed run, unsigned or badly signed; if so, deleted.

    A forged seal or ``closed`` makes a join's transaction fail; the joiner deletes it (only while the key
    still holds it) and tries again, instead of obeying it.
    """
    reason = None if value is None else layout.forgery(key, value)
    if value is None or reason is None:
        return False
    log.warning("The rendezvous key %s holds a value that no agent of this signed run wrote (%s); it is ignored "
                "and deleted.", key.decode(errors="replace"), reason)  # fmt: skip
    client.delete_if_value(key, value, "deleting a forged rendezvous key")
    return True
