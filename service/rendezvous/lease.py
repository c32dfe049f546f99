"""One etcd lease per run, shared by every agent and kept alive by each.

A v3 ``put`` does not refresh a lease, and a lease per write leaked hundreds of
leases in a prototype. Here the first agent of a run grants a lease and
publishes its id under ``<prefix>/<run_id>/lease`` (a key bound to that same
lease); every agent then attaches the state key and all store keys to it and
refreshes it. The run's keys therefore vanish ``ttl`` seconds after the last
agent is gone, and never while one is alive.
"""

from __future__ import annotations

import logging
import threading

from .client import EtcdClient, EtcdError

log = logging.getLogger(__name__)


class RunLease:
    """The shared lease of one run, with a background keep-alive thread."""

    def __init__(self, client: EtcdClient, lease_key: bytes, ttl: int) -> None:
        self._client = client
        self._key = lease_key
        self._ttl = ttl
        self._id: int | None = None
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
        existing = self._read_published()
        if existing is not None and self._is_alive(existing):
            return existing
        granted = self._client.call(lambda c: c.lease(self._ttl).id, "granting the run lease")
        tx = self._client.raw.transactions
        won, responses = self._client.call(
            lambda c: c.transaction(
                compare=[tx.create(self._key) == 0],
                success=[tx.put(self._key, str(granted), lease=granted)],
                failure=[tx.get(self._key)],
            ),
            "publishing the run lease",
        )
        if won:
            return granted
        # Another agent published first: use its lease and drop ours.
        self._revoke(granted)
        return int(responses[0][0][0])

    def _read_published(self) -> int | None:
        value, _ = self._client.call(lambda c: c.get(self._key), "reading the run lease")
        return None if value is None else int(value)

    def _is_alive(self, lease_id: int) -> bool:
        info = self._client.call(lambda c: c.get_lease_info(lease_id), "checking the run lease")
        return info.TTL > 0

    def _revoke(self, lease_id: int) -> None:
        try:
            self._client.call(lambda c: c.revoke_lease(lease_id), "revoking a spare lease")
        except EtcdError:
            log.debug("Revoking spare lease %x failed; it will expire.", lease_id, exc_info=True)

    def _keep_alive_loop(self) -> None:
        interval = max(self._ttl / 3.0, 0.5)
        while not self._stop.wait(interval):
            try:
                self._refresh_once()
            except Exception:  # the agent must not die from a missed refresh
                log.warning("Refreshing the etcd rendezvous lease failed; retrying.", exc_info=True)

    def _refresh_once(self) -> None:
        with self._lock:
            lease_id = self._id
        if lease_id is None:
            return
        responses = self._client.call(lambda c: list(c.refresh_lease(lease_id)), "refreshing the run lease")
        if not responses or responses[0].TTL <= 0:
            log.warning("The etcd rendezvous lease %x expired; the next write will join a new one.", lease_id)
            self.invalidate(lease_id)
