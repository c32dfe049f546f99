"""An etcd-native ``RendezvousHandler``: one lease per node, one key per node per round, watches, one sealing write.

torch's ``DynamicRendezvousHandler`` keeps the whole membership in one pickled value that every join and
heartbeat rewrites and every node polls: O(N) writes per heartbeat to one key, O(N²) requests per round, a
revision per heartbeat. Here (key layout in ``records.py``, the rules in ``rounds.py``, docs/rendezvous.md):
each node holds its own lease (TTL = the liveness timeout), refreshed by keep-alives that write no revision;
a join is one transaction writing one JSON key on that lease; each node keeps a watched copy of the keys that
matter to it (``mirror.py``, ``watching.py``), so nobody polls, ``num_nodes_waiting`` costs no request, and a
join reaches only the round's first few joiners; the first joiner seals the round with one transaction (its
ranks, one key per member, in chunks with it: ``sealing.py``), and every node reads the small seal and then its
own rank key, O(1) bytes each; a dead node's key goes with its lease, and the survivors'
``num_nodes_waiting`` turns positive, so torchrun restarts them into a new round.

Split-brain guard: once this node is a member of a sealed round, its own key and that round's seal must stay.
If either vanishes, :class:`RunLostError` is raised now and on every later call: the agent stops its workers
and exits, and never joins a second world under the same run id.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from service.rendezvous.client import EtcdError, LeaseNotFoundError, prefix_end
from service.rendezvous.lease import NodeLease, RunLostError
from service.rendezvous.native.errors import closed_error, connection_error, join_timeout_error, node_lease_ttl
from service.rendezvous.native.guard import SplitBrainGuard
from service.rendezvous.native.mirror import Mirror
from service.rendezvous.native.records import ClosedRecord, Layout, NodeRecord, SealRecord
from service.rendezvous.native.rounds import RoundView, latest_sealed, seal_due, try_join, view_round
from service.rendezvous.native.sealing import Sealing
from service.rendezvous.native.watching import ROUNDS, RoundWatches
from service.rendezvous.ports import listen_port
from service.rendezvous.requests import RangeRead

if TYPE_CHECKING:
    from service.rendezvous.parts import Etcd3Parts

log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
_SETTLE = 0.01
_REJOINS = 3


class NativeRendezvousHandler(SplitBrainGuard, RoundWatches, Sealing, RendezvousHandler):
    """torch's handler interface on etcd leases, per-node keys, watches and transactions."""

    def __init__(
        self, parts: Etcd3Parts, min_nodes: int, max_nodes: int, local_addr: str | None, share_tcp_store: bool
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"The node range {min_nodes}:{max_nodes} is invalid; need 1 <= min <= max.")
        self._parts = parts
        o = parts.options
        self._min, self._max = min_nodes, max_nodes
        self._addr = local_addr or _hostname()
        self._node = _UNSAFE.sub("_", f"{self._addr}_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        self._share_tcp_store = share_tcp_store
        self._layout = Layout.of(o.key_prefix, o.run_id, o.secret)
        layout = self._layout
        # On a signed run, forged values are left out of the copy and deleted (records.py).
        self._mirror = Mirror(parts.client, layout.base, lambda key: not key.startswith(layout.rounds), layout.forgery)
        ttl = node_lease_ttl(o.keep_alive_interval, o.keep_alive_max_attempt)
        self._lease = NodeLease(parts.client, ttl, o.keep_alive_interval, self._on_lease_lost)
        self._started = False
        self._lock = threading.Lock()
        self._key: bytes | None = None  # this node's key in its current round
        self._joined_at = 0  # the revision of the write that put it there
        self._sealer = False  # holds a seat of its round: it watches the whole round and may seal it
        self._round: int | None = None  # the sealed round this node is a member of
        self._seal_created = 0
        self._sealed: SealRecord | None = None  # the seal of the round it is a member of
        self._seal_revision = 0
        self._member_of = -1  # the last round it was a member of, written into its next join (``seal_due``)
        self._lost: RunLostError | None = None
        self._evicted: str | None = None  # its key went while etcd did not answer: it rejoins (see _gone)
        self._tcp_store: dist.TCPStore | None = None
        self._bootstrap: RendezvousStoreInfo | None = None
        self.tries = 0  # seal and join transactions that lost a race, for the benchmark
        self.writes = 0  # join and seal transactions sent

    # -- torch's interface ------------------------------------------------------
    def get_backend(self) -> str:
        return "etcd3"

    def get_run_id(self) -> str:
        return self._parts.options.run_id

    @property
    def use_agent_store(self) -> bool:
        return self._share_tcp_store

    @property
    def node(self) -> str:
        """This node's id (its key name in a round)."""
        return self._node

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            self.start()
            deadline = time.monotonic() + self._parts.options.join_timeout
            if self._round is not None:
                self._member_of = self._round
            self._round, self._sealed, self._seal_created = None, None, 0
            if self._evicted is not None or self._lease.lost is not None:  # its old key is gone: a fresh lease
                self._evicted, self._key = None, None
                self._renew_lease()
            try:
                round_no, seal, self._seal_revision, rank = self._join_and_wait(deadline)
            except RunLostError:
                raise
            except BaseException:
                self._leave()
                raise
            self._round, self._sealed = round_no, seal
            self._watch_as_member(round_no, seal, self._seal_revision)
            world = seal.world
        log.info(
            "The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d.",
            self._node, round_no, self.get_run_id(), rank, world,
        )  # fmt: skip
        store = dist.PrefixStore(f"torch.rendezvous.{self.get_run_id()}.{round_no}", self._parts.store)
        return RendezvousInfo(store, rank, world, self._bootstrap_info(rank, store))

    def is_closed(self) -> bool:
        self._check()
        self.start()
        with self._mirror.cond:
            return self._layout.closed in self._mirror.items()

    def set_closed(self) -> None:
        self._check()
        record = self._layout.encode(self._layout.closed, ClosedRecord(closed_by=self._node, closed_at=time.time()))
        for _ in range(3):
            lease_id = self._run_lease_id()
            try:
                self._put_closed(record, lease_id)
                return
            except LeaseNotFoundError:
                self._parts.lease.invalidate(lease_id)
            except EtcdError as exc:
                raise connection_error(exc) from exc
        raise RendezvousConnectionError("Closing the rendezvous failed: the run's lease kept vanishing.")

    def _put_closed(self, record: bytes, lease_id: int) -> None:
        self._parts.client.call(lambda c: c.put(self._layout.closed, record, lease=lease_id), "closing the rendezvous")

    def num_nodes_waiting(self) -> int:
        self._check()
        self.start()
        with self._mirror.cond:
            entries = self._mirror.items()
            if self._layout.closed in entries:
                return 0
            if self._round is not None:
                self._guard(entries)
                if self._evicted is not None:
                    return 1  # its own key is gone: torchrun stops its workers and calls next_rendezvous
                return self._waiting_and_departed()  # from its watches: no request
            newest = latest_sealed(self._layout, entries)
        # In no world (torchrun does not ask then): how many joined the next round, read from etcd.
        prefix = self._layout.round_prefix(0 if newest is None else newest + 1)
        try:
            return self._parts.client.count(RangeRead(prefix, prefix_end(prefix)), "counting the waiting nodes")
        except EtcdError as exc:
            raise connection_error(exc) from exc

    def shutdown(self) -> bool:
        try:
            if self._lost is not None:
                return False
            self.set_closed()
            log.info("The node '%s' has closed the rendezvous '%s'.", self._node, self.get_run_id())
            return True
        except RendezvousError as exc:
            log.warning("The node '%s' failed to close the rendezvous: %s", self._node, exc)
            return False
        finally:
            self.close()

    def close(self) -> None:
        """Give back this node's lease (its key vanishes now), stop watching, close the clients."""
        self._lease.revoke()
        self._mirror.stop()
        if self._tcp_store is not None:
            self._tcp_store = None
        self._parts.close()

    # -- joining ----------------------------------------------------------------
    def start(self) -> None:
        """Grant this node's lease and start watching the run's keys (once); closes everything on failure."""
        if self._started:
            return
        try:
            self._lease.grant()
            self._mirror.start(self._control_ranges())
        except EtcdError as exc:
            self.close()
            raise connection_error(exc) from exc
        self._started = True

    def _join_and_wait(self, deadline: float) -> tuple[int, SealRecord, int, int]:
        """Join rounds until one is sealed with this node in it: (its number, its seal, the seal's revision, its
        rank)."""
        with self._mirror.cond:
            newest = latest_sealed(self._layout, self._mirror.items())
        round_no = 0 if newest is None else newest + 1
        rejoins = 0
        while True:
            self._drop_round_watches()
            if self._join(round_no):  # refused, sealed first: its key is not in it, nor is this node
                round_no += 1
                continue
            sealed = None
            if self._lease.lost is None:
                with self._mirror.cond:
                    deletions = self._mirror.deletions
                self._watch_round(round_no)
                sealed = self._wait_for_seal(round_no, deadline, deletions)
            if sealed is None:
                # Its key vanished while it waited (its lease expired in a stall): it is in no world yet, so it
                # takes a fresh lease and joins again; a member that loses its lease fails instead.
                rejoins += 1
                if rejoins > _REJOINS:
                    raise self._lose(f"its key in round {round_no} vanished {rejoins} times before it was sealed")
                log.warning("The node '%s' lost its key in round %d before the seal; joining again.", self._node,
                            round_no)  # fmt: skip
                self._key = None
                self._renew_lease()
                continue
            seal, seal_revision = sealed
            rank = self._read_rank(round_no, seal)
            if rank is not None:
                return round_no, seal, seal_revision, rank
            round_no += 1  # sealed without this node: the next round

    def _renew_lease(self) -> None:
        try:
            self._lease.renew()
        except EtcdError as exc:
            raise connection_error(exc) from exc

    def _join(self, round_no: int) -> bool:
        """Write this node's key into ``round_no``; whether it was refused, the round being sealed first."""
        try:
            lease_id = self._lease.grant()
            self.writes += 1
            joined = try_join(self._parts.client, self._layout, round_no, self._record(round_no), lease_id, self._key)
            if joined.revision:
                self._key, self._joined_at = self._layout.node_key(round_no, self._node), joined.revision
                self._sealer = joined.sealer
        except LeaseNotFoundError:
            self._lease.lost = self._lease.lost or f"its node lease was gone when it joined round {round_no}"
            return False  # in no world yet: _join_and_wait takes a fresh lease
        except EtcdError as exc:
            raise connection_error(exc) from exc
        if joined.closed is not None:
            raise self._closed_error()
        if joined.revision:
            return False
        self.tries += 1
        if joined.seal is None:
            raise RendezvousConnectionError(f"Joining round {round_no} was refused, but etcd shows no reason.")
        self._layout.decode(SealRecord, joined.seal, self._layout.seal_key(round_no))  # a planted seal is refused
        return True

    def _record(self, round_no: int) -> NodeRecord:
        return NodeRecord(node=self._node, addr=self._addr, pid=os.getpid(), round=round_no, member_of=self._member_of)

    def _wait_for_seal(self, round_no: int, deadline: float, deletions: int) -> tuple[SealRecord, int] | None:
        """The round's seal (and its revision) once it is there; ``None`` if this node's key vanished before.

        A sealer (a node with one of the round's seats) decides from its copy of the whole round when to seal. Any
        other node waits for the seal, and takes a seat that its copy shows free.
        """
        due_since: float | None = None
        mirror, layout = self._mirror, self._layout
        seal_key = layout.seal_key(round_no)
        view: RoundView | None = None
        leader, looked_at, wake, revision, tried = True, 0.0, None, 0, 0
        while True:
            with mirror.cond:
                self._check_locked()
                entries = mirror.items()
                if layout.closed in entries:
                    raise self._closed_error()
                sealed = entries.get(seal_key)
                if sealed is not None:
                    return layout.decode(SealRecord, sealed.value, seal_key), sealed.mod_revision
                if self._own_key_gone() or self._lease.lost is not None:
                    return None
                now, seen = time.monotonic(), mirror.revision
                deleted, deletions = mirror.deletions != deletions, mirror.deletions
                free = self._seat_free(round_no, tried)
                # Only the first joiner seals, and it stays first until a key is deleted: the other sealers look
                # at the whole round only after a deletion, or twice a second for the backup seal.
                rounds = mirror.range(ROUNDS)
                look = view is None or leader or deleted or now - looked_at >= 0.5
                if self._sealer and rounds is not None and look:
                    view, revision = view_round(layout, entries, round_no), rounds.revision
                    due = seal_due(view, self._min, self._max)
                    due_since = None if due is None else (due_since or now)
                    wake = self._seal_wake(view, due, due_since)
                    # First unless a key joined before this node's own write (known even before the copy shows it).
                    leader = not view.joined or view.joined[0].create_revision >= self._joined_at
                    looked_at = now
            if now >= deadline:
                raise self._join_timeout(round_no, view)
            if free:
                tried = free
                self._take_seat(round_no)
                continue
            if self._sealer and wake is not None and wake <= now and view is not None:
                self._seal(view, revision)
                view = None
                continue
            with mirror.cond:
                quiet = mirror.revision == seen and mirror.error is None
                if quiet and self._lease.lost is None and self._lease.unavailable is None:
                    limit = deadline if wake is None else min(deadline, wake)
                    if not self._sealer or leader:
                        mirror.cond.wait(max(0.0, limit - time.monotonic()))
                    else:  # a backup sealer: only a seal, a close or a departure matters to it
                        mirror.major_cond.wait(max(0.0, min(limit, looked_at + 0.5) - time.monotonic()))
            # Joins arrive in bursts when many nodes start together: let a burst land before looking again.
            time.sleep(_SETTLE)

    def _join_timeout(self, round_no: int, view: RoundView | None) -> RendezvousTimeoutError:
        return join_timeout_error(self.get_run_id(), self._parts.options.join_timeout, round_no, self._min, view)

    def _leave(self) -> None:
        """Take this node's key out of its round (a failed or timed-out join)."""
        key, self._key = self._key, None
        if key is None or self._lost is not None:
            return
        try:
            self._parts.client.call(lambda c: c.delete(key), "leaving the rendezvous round", retry=False)
        except EtcdError:
            log.debug("Deleting %r failed; it goes with the node lease.", key, exc_info=True)

    # -- the store handed to the agent ---------------------------------------------
    def _bootstrap_info(self, rank: int, store: dist.Store) -> RendezvousStoreInfo:
        if not self._share_tcp_store:  # rank 0's worker listens on the port later (ports.py says why not torch's)
            port = listen_port() if rank == 0 else None
            return RendezvousStoreInfo.build(rank, store, local_addr=self._addr, server_port=port)
        # As torch's own handler: rank 0 hosts a TCPStore the workers share, built once per agent.
        if self._bootstrap is None or (rank == 0 and self._tcp_store is None):
            port = 0
            if rank == 0:
                self._tcp_store = dist.TCPStore(host_name=self._addr, port=0, is_master=True, multi_tenant=True)
                port = self._tcp_store.port
            self._bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._addr, server_port=port)
        return self._bootstrap

    def _closed_error(self) -> RendezvousClosedError:
        return closed_error(self.get_run_id())


def _hostname() -> str:
    import socket

    return socket.getfqdn()
