"""etcd requests that pyetcd's helpers cannot express, built from etcd's own messages.

pyetcd's transactions read whole ranges only (no keys-only read, no limit, no
order), and its watches take one range per stream. The native rendezvous reads
several ranges at one revision in one transaction, learns a round's first
joiners in its join transaction, and keeps several watches, some for
deletions or puts only, on one stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyetcd import etcdrpc

# What a watch passes on: everything, only deletions (etcd filters the puts out), or only puts.
ALL, DELETES, PUTS = "all", "deletes", "puts"
_FILTERS = {
    ALL: [],
    DELETES: [etcdrpc.WatchCreateRequest.NOPUT],
    PUTS: [etcdrpc.WatchCreateRequest.NODELETE],
}


@dataclass(frozen=True)
class RangeRead:
    """One read of ``key`` (up to ``end``; ``None``: the one key): values or keys only, all or the first ``limit``,
    by key or (``by_create``) by creation, or only how many keys there are (``count_only``)."""

    key: bytes
    end: bytes | None = None
    keys_only: bool = False
    limit: int = 0
    by_create: bool = False
    count_only: bool = False

    def request(self) -> Any:
        read = etcdrpc.RangeRequest(key=self.key, keys_only=self.keys_only, limit=self.limit,
                                    count_only=self.count_only)  # fmt: skip
        if self.end is not None:
            read.range_end = self.end
        if self.by_create:
            read.sort_target = etcdrpc.RangeRequest.CREATE
            read.sort_order = etcdrpc.RangeRequest.ASCEND
        return read

    def op(self) -> Any:
        return etcdrpc.RequestOp(request_range=self.request())


def put_op(key: bytes, value: bytes, lease: int = 0) -> Any:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes, end: bytes | None = None) -> Any:
    request = etcdrpc.DeleteRangeRequest(key=key)
    if end is not None:
        request.range_end = end
    return etcdrpc.RequestOp(request_delete_range=request)


def txn_request(compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> Any:
    """A transaction of etcd's messages; ``compare`` takes pyetcd's comparisons (``tx.create(key) == 0``)."""
    return etcdrpc.TxnRequest(
        compare=[c.build_message() for c in compare], success=list(success), failure=list(failure)
    )


@dataclass(frozen=True)
class WatchSpec:
    """One watch: ``key`` (up to ``end``; ``None``: the one key) from ``start_revision``, passing on what ``kind``
    names (``ALL``, ``DELETES`` or ``PUTS``)."""

    key: bytes
    end: bytes | None
    start_revision: int
    kind: str

    @property
    def filters(self) -> list[Any]:
        return _FILTERS[self.kind]
