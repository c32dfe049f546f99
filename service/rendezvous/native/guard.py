"""The native handler's split-brain guard: once this node is a member of a sealed round, that round's
seal and this node's key must stay, or the node is lost for good and never joins a second world.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.rendezvous.lease import NodeLease, RunLostError
from service.rendezvous.native.errors import connection_error, lost_error
from service.rendezvous.native.mirror import Mirror
from service.rendezvous.native.records import Layout

if TYPE_CHECKING:
    from service.rendezvous.parts import Etcd3Parts

log = logging.getLogger("service.rendezvous.native.handler")  # its records read as the handler's


class SplitBrainGuard:
    """The part of NativeRendezvousHandler that guards against a split brain.

    NativeRendezvousHandler sets these attributes.
    """

    _evicted: str | None
    _key: bytes | None
    _layout: Layout
    _lease: NodeLease
    _lost: RunLostError | None
    _mirror: Mirror
    _own_key_gone: Callable[[], bool]  # RoundWatches
    _node: str
    _parts: Etcd3Parts
    _round: int | None
    _seal_created: int

    # -- the split-brain guard ------------------------------------------------------
    def _guard(self, entries: dict) -> None:
        """As a member of a sealed round: its seal and this node's key must still be there (``cond`` held)."""
        if self._round is None:
            return
        seal = entries.get(self._layout.seal_key(self._round))
        if seal is None:
            raise self._lose(f"the seal of its round {self._round} was deleted")
        if self._seal_created and seal.create_revision != self._seal_created:
            raise self._lose(f"the seal of its round {self._round} was deleted and written again")
        self._seal_created = seal.create_revision
        if self._own_key_gone():
            self._gone(f"its node key in round {self._round} vanished")

    def _on_lease_lost(self, reason: str) -> None:
        """The node lease is gone (``reason``), or etcd unreachable past the grace window (no reason): wake waiters."""
        with self._mirror.cond:
            if reason and self._round is not None:  # a member: its world goes on without it, or it rejoins
                try:
                    self._gone(reason)
                except RunLostError:
                    pass  # kept in self._lost, raised by the next call
            self._mirror.cond.notify_all()

    def _gone(self, what: str) -> None:
        """As a member, its key or lease is gone (``what``); raises ``RunLostError`` unless etcd was not answering.

        While etcd did not answer (an outage, a frozen etcd, a cut to it), its lease expired through nobody's
        act: a frozen etcd expires every lease when it wakes. Then it is evicted, not lost: its workers are
        stopped (``num_nodes_waiting`` turns positive) and it joins a later round with a fresh lease, as any
        new node would. Lost otherwise (its lease revoked while etcd answered): it exits and never rejoins.
        """
        if self._lost is None and self._evicted is None and self._lease.lost_while_unreachable():
            log.warning("The node '%s' is out of round %d: %s while etcd was not answering; it stops its workers "
                        "and joins the next round.", self._node, self._round, what)  # fmt: skip
            self._evicted = what
        if self._evicted is None:
            raise self._lose(what)

    def _lose(self, what: str) -> RunLostError:
        self._lost = self._lost or self._lost_error(what)
        return self._lost

    def _lost_error(self, what: str) -> RunLostError:
        return lost_error(self._parts.options.run_id, self._parts.options.key_prefix, what)

    def _check(self) -> None:
        with self._mirror.cond:
            self._check_locked()

    def _check_locked(self) -> None:
        if self._lost is None and self._evicted is None and self._lease.lost is not None and self._round is not None:
            self._gone(self._lease.lost)
        if self._lost is not None:
            raise RunLostError(str(self._lost))
        if self._mirror.error is not None:
            raise connection_error(self._mirror.error)
        if self._lease.unavailable is not None:
            raise connection_error(self._lease.unavailable)
