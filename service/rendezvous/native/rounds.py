"""The rules of the native rendezvous: what a round looks like, when it may be sealed, and the two writes.

A node joins round ``t`` (the round after the newest sealed one) with one
transaction that writes its :class:`NodeRecord` on its own lease, and only if
``t`` is not sealed yet and the run is not closed. Round ``t`` is sealed by
one transaction that writes its :class:`SealRecord` only if

* nobody sealed ``t`` before (``create_revision`` of the seal key is 0),
* the run is not closed,
* no node key of round ``t`` changed after the revision the sealer decided on
  (a joiner that arrived meanwhile makes the seal fail, and the sealer decides
  again with it included), and
* no node key is left in an earlier round: every member of the previous round
  has either moved on to ``t`` or died (its key went with its lease).

Members are the first ``max_nodes`` joiners in ``create_revision`` order;
ranks follow the node ids (which start with the node's address), as torch's
own handler sorts its participants. Every node reads the same sealed record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from service.rendezvous.client import EtcdClient, EtcdError, prefix_end
from service.rendezvous.native.mirror import Entry
from service.rendezvous.native.records import Layout, NodeRecord, SealRecord

log = logging.getLogger(__name__)
_PURGES = 5  # joins refused by forged values (each then deleted) before giving up


@dataclass(frozen=True)
class Joiner:
    """A node key of one round: join order, node id and where the node is."""

    create_revision: int
    node: str
    addr: str


@dataclass(frozen=True)
class RoundView:
    """What a node's copy of the keys says about round ``round``."""

    round: int
    joined: tuple[Joiner, ...]  # in join order
    earlier: int  # node keys still in rounds before ``round``
    seal: SealRecord | None
    seal_created: int  # create_revision of the seal key (0: none)
    previous: SealRecord | None  # the seal of round - 1, if still kept
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
            joined.append(Joiner(entry.create_revision, node, record.addr))
    joined.sort(key=lambda j: (j.create_revision, j.node))
    seal_entry = entries.get(layout.seal_key(round_no))
    seal = None if seal_entry is None else layout.decode(SealRecord, seal_entry.value, layout.seal_key(round_no))
    prev_entry = entries.get(layout.seal_key(round_no - 1)) if round_no > 0 else None
    previous = (
        None if prev_entry is None else layout.decode(SealRecord, prev_entry.value, layout.seal_key(round_no - 1))
    )
    return RoundView(
        round=round_no,
        joined=tuple(joined),
        earlier=earlier,
        seal=seal,
        seal_created=0 if seal_entry is None else seal_entry.create_revision,
        previous=previous,
        closed=layout.closed in entries,
    )


def seal_due(view: RoundView, min_nodes: int, max_nodes: int) -> str | None:
    """When round ``view.round`` may be sealed: ``"now"``, ``"last_call"`` (after the last call), or ``None``.

    Full (``max_nodes`` joined): now. A re-formed world (at least one member of
    the previous round is back and every other one has moved on or died): now,
    since every node known to be alive is in and nobody else is known to come.
    Otherwise, with ``min_nodes`` in: after the last call.
    """
    if view.seal is not None or view.closed or not view.drained or len(view.joined) < min_nodes:
        return None
    if len(view.joined) >= max_nodes:
        return "now"
    if view.previous is not None and {j.node for j in view.joined} & set(view.previous.members):
        return "now"
    return "last_call"


def try_join(
    client: EtcdClient, layout: Layout, round_no: int, record: NodeRecord, lease_id: int, leave: bytes | None
) -> tuple[int, bytes | None, bytes | None]:
    """Write this node's key into ``round_no`` (deleting ``leave``, its key of an earlier round) in one transaction.

    Returns (the revision of the write, 0 if it was refused; the round's seal value if it was sealed; the
    closed record if the run is closed). On a signed run, a forged seal or ``closed`` that refused the write
    is deleted and the join tried again (``EtcdError`` if someone keeps writing them).
    """
    tx = client.raw.transactions
    key, seal_key = layout.node_key(round_no, record.node), layout.seal_key(round_no)
    success = [tx.put(key, layout.encode(key, record), lease=lease_id)]
    if leave is not None and leave != key:
        success.insert(0, tx.delete(leave))
    for _ in range(_PURGES):
        won, responses = client.call(
            lambda c: c.transaction(
                compare=[tx.create(seal_key) == 0, tx.version(layout.closed) == 0],
                success=success,
                failure=[tx.get(seal_key), tx.get(layout.closed)],
            ),
            "joining the rendezvous round",
        )
        if won:
            return int(responses[-1].response_put.header.revision), None, None
        seal = responses[0][0][0] if responses[0] else None
        closed = responses[1][0][0] if responses[1] else None
        if not (delete_forged(client, layout, layout.closed, closed) or delete_forged(client, layout, seal_key, seal)):
            return 0, seal, closed
    raise EtcdError(
        f"Joining round {round_no} was refused {_PURGES} times by values that no agent of this signed run wrote; "
        "someone keeps writing them under the run's prefix. Restrict it with etcd's authentication."
    )


def try_seal(
    client: EtcdClient, layout: Layout, view: RoundView, decided_at: int, max_nodes: int, sealer: str, lease_id: int
) -> bool:
    """Seal ``view.round`` with its first ``max_nodes`` joiners, if nothing changed after revision ``decided_at``."""
    tx = client.raw.transactions
    # Members: the first max_nodes joiners. Ranks: by node id (address first), as torch's own handler sorts them.
    members = sorted(view.members(max_nodes), key=lambda j: j.node)
    record = SealRecord(
        round=view.round,
        members=[m.node for m in members],
        addrs=[m.addr for m in members],
        sealed_by=sealer,
        sealed_at=time.time(),
    )
    round_prefix = layout.round_prefix(view.round)
    seal_key = layout.seal_key(view.round)
    success = [tx.put(seal_key, layout.encode(seal_key, record), lease=lease_id)]
    if view.round >= 2:  # seals older than the previous round are no longer read by anyone
        success.append(tx.delete(layout.seals, range_end=layout.seal_key(view.round - 1)))
    won, _ = client.call(
        lambda c: c.transaction(
            compare=[
                tx.create(layout.seal_key(view.round)) == 0,
                tx.version(layout.closed) == 0,
                tx.mod(round_prefix, range_end=prefix_end(round_prefix)) < decided_at + 1,
                tx.version(layout.rounds, range_end=round_prefix) == 0,
            ],
            success=success,
            failure=[],
        ),
        "sealing the rendezvous round",
    )
    return bool(won)


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
