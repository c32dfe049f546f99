"""The native handler's part in sealing a round and in learning its rank once the round is sealed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.rendezvous.client import EtcdError, LeaseNotFoundError
from service.rendezvous.lease import NodeLease
from service.rendezvous.native.errors import connection_error
from service.rendezvous.native.mirror import Mirror
from service.rendezvous.native.records import Layout, SealRecord
from service.rendezvous.native.rounds import RoundView, read_rank, try_seal

if TYPE_CHECKING:
    from service.rendezvous.parts import Etcd3Parts


class Sealing:
    """The part of NativeRendezvousHandler that seals rounds and reads ranks. NativeRendezvousHandler sets these."""

    _layout: Layout
    _lease: NodeLease
    _max: int
    _mirror: Mirror
    _node: str
    _parts: Etcd3Parts
    _saw_since: Callable[[int, int], bool]  # RoundWatches
    tries: int
    writes: int

    def _seal_wake(self, view: RoundView, due: str | None, due_since: float | None) -> float | None:
        """When this node should try to seal: the first joiner at once (or after the last call), others as backup."""
        if due is None or due_since is None or not view.joined:
            return None
        wait = 0.0 if due == "now" else self._parts.options.last_call_timeout
        if view.joined[0].node != self._node:
            # Only the first joiner seals; the others step in if it has not after one more liveness timeout.
            wait += self._lease.ttl
        return due_since + wait

    def _seal(self, view: RoundView, revision: int) -> None:
        lease_id = self._run_lease_id()
        self.writes += 1
        try:
            if not try_seal(self._parts.client, self._layout, view, revision, self._max, self._node, lease_id):
                self.tries += 1
                with self._mirror.cond:  # something changed after `revision`: wait until the copy shows it
                    self._mirror.wait_until(
                        lambda: self._saw_since(view.round, revision),
                        time.monotonic() + self._parts.options.client.read_timeout,
                    )
        except LeaseNotFoundError:
            self._parts.lease.invalidate(lease_id)
        except EtcdError as exc:
            raise connection_error(exc) from exc

    def _read_rank(self, round_no: int, seal: SealRecord) -> int | None:
        """This node's rank in sealed round ``round_no`` (one read of its own rank key); ``None``: not a member."""
        try:
            return read_rank(self._parts.client, self._layout, round_no, seal, self._node)
        except EtcdError as exc:
            raise connection_error(exc) from exc

    def _run_lease_id(self) -> int:
        try:
            return self._parts.lease.id()
        except EtcdError as exc:
            raise connection_error(exc) from exc
