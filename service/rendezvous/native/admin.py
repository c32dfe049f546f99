"""What ``ddp-service rdzv`` reads and writes for a run of the native handler (keys under ``<run>/rdzv/``).

The ranks of a sealed round are read from its sealer's rank keys (``ranks/<r>/<sealer>/``): an admin tool
may read O(N). Everything there is validated JSON (``records.py``); nothing is unpickled. A
node counts as live while its key exists: the key is on the node's own lease,
so it vanishes within the lease TTL once the node stops refreshing it.
"""

from __future__ import annotations

import time
from typing import Any

from service.rendezvous.native.records import (
    ClosedRecord,
    Layout,
    NodeRecord,
    RankRecord,
    RecordError,
    SealRecord,
)


def describe(raw: Any, key_prefix: str, run_id: str, info: Any, secret: bytes | None) -> bool:
    """Fill ``info`` (``admin.RunInfo``) from the native keys of ``run_id`` (read with the pyetcd client ``raw``).

    Returns ``False`` if the run has no native keys.
    """
    layout = Layout.of(key_prefix, run_id, secret)
    found = list(raw.get_prefix(layout.base))
    if not found:
        return False
    info.has_state = True
    nodes: dict[int, list[tuple[str, int]]] = {}
    seals: dict[int, SealRecord] = {}
    ranks: dict[tuple[int, str], list[tuple[int, str, int, int]]] = {}  # (round, sealer) -> (rank, node, world, cutoff)
    try:
        for value, meta in found:
            parsed = layout.parse_node_key(meta.key)
            if parsed is not None:
                record = layout.decode(NodeRecord, value, meta.key)
                nodes.setdefault(parsed[0], []).append((record.node, meta.create_revision))
            elif (round_no := layout.parse_seal_key(meta.key)) is not None:
                seals[round_no] = layout.decode(SealRecord, value, meta.key)
            elif (rank_key := layout.parse_rank_key(meta.key)) is not None:
                rank = layout.decode(RankRecord, value, meta.key)
                ranks.setdefault(rank_key[:2], []).append((rank.rank, rank_key[2], rank.world, rank.cutoff))
            elif meta.key == layout.closed:
                layout.decode(ClosedRecord, value, meta.key)
                info.closed = True
    except RecordError as exc:
        info.note = f"state not decoded: {exc}"
        return True
    info.decoded = True
    info.closed = bool(info.closed)
    newest = max(seals) if seals else None
    info.round = newest if newest is not None else (min(nodes) if nodes else None)
    info.complete = newest is not None
    if newest is not None:
        live = {node for node, _ in nodes.get(newest, [])}
        info.participants = [
            {"node": node, "rank": rank, "heartbeat_age": 0.0 if node in live else None}
            for rank, node, world, cutoff in sorted(ranks.get((newest, seals[newest].sealed_by), []))
            if (world, cutoff) == (seals[newest].world, seals[newest].cutoff)  # not a failed try's leftover
        ]
    after = -1 if newest is None else newest
    waiting = [(rev, node) for r, entries in nodes.items() if r > after for node, rev in entries]
    info.wait_list = [{"node": node, "heartbeat_age": 0.0} for _, node in sorted(waiting)]
    return True


def mark_closed(client: Any, key_prefix: str, run_id: str, lease_id: int | None, secret: bytes | None) -> bool:
    """Write the run's closed record (on the run's lease when it has one)."""
    layout = Layout.of(key_prefix, run_id, secret)
    record = layout.encode(layout.closed, ClosedRecord(closed_by="ddp-service rdzv retire", closed_at=time.time()))
    if lease_id:
        client.call(lambda c: c.put(layout.closed, record, lease=lease_id), "marking the run closed")
    else:
        client.call(lambda c: c.put(layout.closed, record), "marking the run closed")
    return True
