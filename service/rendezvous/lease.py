"""One etcd lease per run, shared by every agent and kept alive by each.

A v3 ``put`` does not refresh a lease, and a lease per write leaked hundreds of
leases in a prototype. Here the first agent of a run grants a lease and
publishes its id under ``<prefix>/<run_id>/lease`` (a key bound to that same
lease); every agent then attaches the state key and all store keys to it and
refreshes it. The run's keys therefore vanish ``ttl`` seconds after the last
agent is gone, and never while one is alive.

An agent that joins a published lease refreshes it at once: a rerun of a
preempted job inherits a lease with only part of its TTL left, and waiting a
third of the TTL for the first refresh let it expire under the new job. The
keep-alive period follows the lease's own TTL (the job that granted it may
have used a shorter ``ttl``), not this agent's option.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from service.rendezvous.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailableError,
)

log = logging.getLogger(__name__)
_PUBLISH_ATTEMPTS = 10


class RunLease:
    """The shared lease of one run, with a background keep-alive thread."""

    def __init__(self, client: EtcdClient, lease_key: bytes, ttl: int) -> None:
        self._client = client
        self._key = lease_key
        self._ttl = ttl
        self._id: int | None = None
        self._granted_ttl = ttl  # the TTL etcd keeps for the lease in use (an inherited one may be shorter)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ttl(self) -> int:
        """The lease's time to live, in seconds."""
        return self._ttl

    def id(self) -> int:
        """The run's lease id, joining or creating the lease on first use."""
        with self._lock:
            if self._id is None:
                self._id = self._join_or_create()
            return self._id

    def invalidate(self, lease_id: int) -> None:
        """Forget a lease that etcd reported missing, so the next write gets a live one."""
        with self._lock:
            if self._id == lease_id:
                self._id = None

    @property
    def refresh_interval(self) -> float:
        """Seconds between refreshes: a third of the TTL of the lease in use (at least 0.5 s)."""
        return max(min(self._ttl, self._granted_ttl) / 3.0, 0.5)

    def start_keep_alive(self) -> None:
        """Refresh the lease every third of its TTL until ``stop``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep_alive_loop, name="etcd3-rdzv-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop refreshing; the lease then expires unless another agent refreshes it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._client.options.read_timeout + 1)

    def _join_or_create(self) -> int:
        """Join the published lease if it lives; else publish a fresh one, atomically.

        The lease key may hold garbage (``notanint``) or the id of a lease etcd no
        longer has (someone wrote it by hand). Either counts as no lease: it is
        replaced by a compare-and-set on the key's revision, with a warning, so a
        stray write never blocks the run id.
        """
        granted: int | None = None
        try:
            for _ in range(_PUBLISH_ATTEMPTS):
                value, revision = self._read_published()
                existing = None if value is None else self._usable(value)
                if existing is not None:
                    if existing == granted:  # our publish landed though its reply was lost
                        granted = None
                    return existing
                if granted is None:
                    granted = self._client.call(lambda c: c.lease(self._ttl).id, "granting the run lease")
                if self._publish(granted, revision):
                    lease_id, granted = granted, None
                    self._granted_ttl = self._ttl
                    return lease_id
                # Another agent published (or replaced) the key first: look again.
            raise EtcdError(
                f"The run lease under etcd key '{self._key.decode(errors='replace')}' changed "
                f"{_PUBLISH_ATTEMPTS} times while this agent tried to join it; another writer keeps "
                "rewriting it. Find that writer, or delete the key."
            )
        finally:
            if granted is not None:
                self._revoke(granted)

    def _usable(self, value: bytes) -> int | None:
        """The published lease id if it names a live lease, refreshed now; ``None`` (with a warning) if not."""
        key = self._key.decode(errors="replace")
        text = value.decode("ascii", errors="replace").strip()
        lease_id = int(text) if text.isdigit() else 0
        if not 0 < lease_id < 2**63:
            log.warning(
                "The etcd key '%s' holds %r, which is not a lease id; replacing it with a new lease.",
                key,
                text[:64],
            )
            return None
        ttl = self._refresh_now(lease_id)
        if ttl <= 0:
            log.warning(
                "The etcd key '%s' names lease %d, which etcd does not have (expired, revoked, or "
                "written by hand); replacing it with a new lease.",
                key,
                lease_id,
            )
            return None
        self._granted_ttl = ttl
        return lease_id

    def _publish(self, granted: int, revision: int) -> bool:
        """Write ``granted`` under the lease key if the key is still at ``revision`` (0: absent)."""
        tx = self._client.raw.transactions
        compare = tx.create(self._key) == 0 if revision == 0 else tx.mod(self._key) == revision
        won, _ = self._client.call(
            lambda c: c.transaction(
                compare=[compare], success=[tx.put(self._key, str(granted), lease=granted)], failure=[]
            ),
            "publishing the run lease",
        )
        return bool(won)

    def _read_published(self) -> tuple[bytes | None, int]:
        value, meta = self._client.call(lambda c: c.get(self._key), "reading the run lease")
        return (None, 0) if value is None else (value, meta.mod_revision)

    def _refresh_now(self, lease_id: int) -> int:
        """Refresh ``lease_id`` once; its TTL in seconds after the refresh, 0 if etcd does not have it."""
        return self._client.refresh_lease(lease_id, "refreshing the run lease")

    def _revoke(self, lease_id: int) -> None:
        try:
            self._client.call(lambda c: c.revoke_lease(lease_id), "revoking a spare lease")
        except EtcdError:
            log.debug("Revoking spare lease %x failed; it will expire.", lease_id, exc_info=True)

    def _keep_alive_loop(self) -> None:
        while not self._stop.wait(self.refresh_interval):
            try:
                self._refresh_once()
            except Exception:  # the agent must not die from a missed refresh
                log.warning("Refreshing the etcd rendezvous lease failed; retrying.", exc_info=True)

    def _refresh_once(self) -> None:
        with self._lock:
            lease_id = self._id
        if lease_id is None:
            return
        if self._refresh_now(lease_id) <= 0:
            log.warning("The etcd rendezvous lease %x expired; the next write will join a new one.", lease_id)
            self.invalidate(lease_id)


class NodeLease:
    """One node's own lease (TTL = its liveness timeout), refreshed every ``interval`` by keep-alive.

    Keep-alives write no revision, so a live node costs etcd no history. When
    etcd reports the lease gone (expired while this agent stalled, or revoked),
    :attr:`lost` is set and ``on_lost`` is called once; the rendezvous treats
    that as the end of this node's part in the run.
    """

    def __init__(self, client: EtcdClient, ttl: int, interval: float, on_lost: Callable[[str], None]) -> None:
        self._client = client
        self._ttl = ttl
        self._interval = interval
        self._on_lost = on_lost
        self._id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None
        self.unavailable: EtcdUnavailableError | None = (
            None  # set while refreshing fails past the client's grace window
        )

    @property
    def ttl(self) -> int:
        return self._ttl

    def lost_while_unreachable(self) -> bool:
        """Whether etcd went unanswered within one TTL (and a retry) of now: its expiry is then an outage's doing."""
        slack = self._interval + 2 * self._client.options.read_timeout
        return self._client.unreachable_within(self._ttl + slack)

    def grant(self) -> int:
        """Grant the lease (once) and start refreshing it; raises ``EtcdError``."""
        if self._id is None:
            self._id = self._client.call(lambda c: c.lease(self._ttl).id, "granting the node lease")
            self._thread = threading.Thread(target=self._loop, name="etcd3-rdzv-node-lease", daemon=True)
            self._thread.start()
        return self._id

    def renew(self) -> int:
        """Replace a lost lease with a fresh one (a node that is in no world yet); raises ``EtcdError``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._client.options.read_timeout + 1)
        self._id, self._thread, self.lost = None, None, None
        self._stop = threading.Event()
        return self.grant()

    def revoke(self) -> None:
        """Stop refreshing and revoke the lease, so this node's keys vanish now rather than after the TTL."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._client.options.read_timeout + 1)
        lease_id, self._id = self._id, None
        if lease_id is not None and self.lost is None:
            try:
                self._client.call(lambda c: c.revoke_lease(lease_id), "revoking the node lease", retry=False)
            except EtcdError:
                log.debug("Revoking node lease %x failed; it expires in %d s.", lease_id, self._ttl, exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            lease_id = self._id
            if lease_id is None:
                return
            try:
                ttl = self._client.refresh_lease(lease_id, "refreshing the node lease")
            except EtcdUnavailableError as exc:  # etcd gone beyond the grace window: the rendezvous reports it
                self.unavailable = exc
                self._on_lost("")
                log.warning("Refreshing the node lease failed; retrying: %s", exc)
                continue
            except Exception:  # a missed refresh is retried at the next interval
                log.warning("Refreshing the node lease failed; retrying.", exc_info=True)
                continue
            self.unavailable = None
            if ttl <= 0:
                self.lost = f"its node lease {lease_id:x} expired or was revoked in etcd"
                self._on_lost(self.lost)
                return


class RunLostError(RendezvousStateError):
    """The run's keys or lease vanished while this agent was part of the run."""
