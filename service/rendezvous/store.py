"""A ``torch.distributed.Store`` on etcd v3, for what the rendezvous hands out.

The torchrun agent uses it for the rank assignment (``set``, ``multi_set``,
blocking ``get``/``multi_get``), for MASTER_ADDR/MASTER_PORT, and for the exit
barrier (``add`` plus ``wait`` under ``set_timeout``). A timeout must raise
``torch.distributed.DistStoreError``: the barrier catches exactly that type.
All keys carry the run's shared lease, so nothing outlives the run.

``clone`` (torch's C++ ``Store`` contract; torch calls it when it splits or
shrinks process groups) gives a store with a client of its own on the same
keys, lease and timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from service.rendezvous.client import EtcdClient, EtcdError, EtcdUncertainError, LeaseNotFoundError, prefix_end
from service.rendezvous.lease import RunLease

T = TypeVar("T")
_POLL_FIRST = 0.005
_POLL_MAX = 0.1
_LEASE_RETRIES = 3


def _as_bytes(value: bytes | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class Etcd3Store(dist.Store):
    """Key-value store for torch under ``<prefix>/``; every key carries the run lease."""

    def __init__(self, client: EtcdClient, prefix: bytes, lease: RunLease, timeout: timedelta | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._prefix = prefix if prefix.endswith(b"/") else prefix + b"/"
        self._lease = lease
        self._owns_client = False
        # pybind11 keeps only the C++ half of a Python store that C++ holds alone:
        # a clone handed to PrefixStore would lose its methods ("Not implemented")
        # once Python dropped it. The original keeps its clones alive, and closes them.
        self._clones: list[Etcd3Store] = []
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def _store_timeout(self) -> timedelta:
        """torch's pybind ``Store.timeout`` (what ``set_timeout`` set); its type stubs do not declare it."""
        return self.timeout  # type: ignore[attr-defined]

    # -- torch's Store contract -----------------------------------------------
    def clone(self) -> Etcd3Store:
        """A new store with its own etcd client, on the same keys, lease and timeout."""
        client = EtcdClient(self._client.options)
        client.end_start()  # a clone serves a running job: the grace window applies from its first request
        twin = Etcd3Store(client, self._prefix, self._lease, self._store_timeout)
        twin._owns_client = True
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        """Close the clients of this store's clones (and its own, if it is a clone)."""
        clones, self._clones = self._clones, []
        for twin in clones:
            twin.close()
        if self._owns_client:
            self._client.close()

    # -- writes ---------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key``."""
        self._with_lease(
            lambda lease_id: self._call(lambda c: c.put(self._k(key), _as_bytes(value), lease=lease_id), "set")
        )

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Write several keys in one transaction."""
        if len(keys) != len(values):
            raise ValueError("multi_set needs as many values as keys.")
        tx = self._client.raw.transactions

        def write(lease_id: int) -> None:
            puts = [tx.put(self._k(k), _as_bytes(v), lease=lease_id) for k, v in zip(keys, values, strict=True)]
            self._call(lambda c: c.transaction(compare=[], success=puts, failure=[]), "multi_set")

        self._with_lease(write)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer under ``key`` (0 when absent)."""
        return self._with_lease(lambda lease_id: self._add(key, int(amount), lease_id))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``desired`` if the value is ``expected`` (or absent and ``expected`` is empty); return the value."""
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        return self._with_lease(lambda lease_id: self._compare_set(key, expected_b, desired_b, lease_id))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; ``True`` if it existed."""
        return bool(self._call(lambda c: c.delete(self._k(key)), "delete_key"))

    deleteKey = delete_key  # the name torch's C++ trampoline calls

    # -- reads ----------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to appear."""
        return self._wait_for([key], self._store_timeout)[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting until all exist."""
        return self._wait_for(list(keys), self._store_timeout)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until all ``keys`` exist or the timeout passes (``DistStoreError``)."""
        self._wait_for(list(keys), self._store_timeout if timeout is None else timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether all ``keys`` exist now, without waiting."""
        return all(v is not None for v in self._fetch(list(keys)))

    def num_keys(self) -> int:
        """How many keys the store holds."""
        end = prefix_end(self._prefix)
        response = self._call(lambda c: c.get_range_response(self._prefix, end, count_only=True), "num_keys")
        return int(response.count)

    getNumKeys = num_keys  # the name torch's C++ trampoline calls

    # -- helpers --------------------------------------------------------------
    def _k(self, key: str | bytes) -> bytes:
        return self._prefix + _as_bytes(key)

    def _call(self, op: Callable, what: str, retry: bool = True):
        try:
            return self._client.call(op, f"the store's {what}", retry=retry)
        except LeaseNotFoundError:
            raise
        except EtcdError as exc:
            raise dist.DistNetworkError(f"The etcd3 store cannot use etcd: {exc}") from exc

    def _with_lease(self, write: Callable[[int], T]) -> T:
        for _ in range(_LEASE_RETRIES):
            lease_id = self._lease_id()
            try:
                return write(lease_id)
            except LeaseNotFoundError:
                self._lease.invalidate(lease_id)
        raise dist.DistNetworkError("The etcd3 store could not obtain a live lease for the run.")

    def _lease_id(self) -> int:
        try:
            return self._lease.id()
        except EtcdError as exc:
            raise dist.DistNetworkError(f"The etcd3 store cannot use etcd: {exc}") from exc

    def _fetch(self, keys: list[str]) -> list[bytes | None]:
        tx = self._client.raw.transactions
        gets = [tx.get(self._k(k)) for k in keys]
        _, responses = self._call(lambda c: c.transaction(compare=[], success=gets, failure=[]), "get")
        return [r[0][0] if r else None for r in responses]

    def _wait_for(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        pause = _POLL_FIRST
        while True:
            values = self._fetch(keys)
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise dist.DistStoreError(
                    f"Timed out: the timeout of {timeout.total_seconds():g} s passed while waiting for "
                    f"the key(s) {missing} in the etcd3 store."
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX)

    def _add(self, key: str, amount: int, lease_id: int) -> int:
        tx = self._client.raw.transactions
        k = self._k(key)
        while True:
            value, meta = self._call(lambda c: c.get(k), "add")
            current = 0 if value is None else int(value)
            compare = tx.create(k) == 0 if value is None else tx.mod(k) == meta.mod_revision
            new = str(current + amount).encode()
            try:
                request = {"compare": [compare], "success": [tx.put(k, new, lease=lease_id)], "failure": []}
                won, _ = self._call(lambda c, request=request: c.transaction(**request), "add", retry=False)
            except EtcdUncertainError:
                # Retry only when the key is provably unchanged; else the add may have landed.
                after, after_meta = self._call(lambda c: c.get(k), "add")
                unchanged = (after is None and value is None) or (
                    after is not None and value is not None and after_meta.mod_revision == meta.mod_revision
                )
                if unchanged:
                    continue
                raise dist.DistNetworkError(
                    f"An add to '{key}' in the etcd3 store timed out and its outcome is unknown."
                ) from None
            if won:
                return current + amount

    def _compare_set(self, key: str, expected: bytes, desired: bytes, lease_id: int) -> bytes:
        tx = self._client.raw.transactions
        k = self._k(key)
        while True:
            compare = tx.create(k) == 0 if expected == b"" else tx.value(k) == expected
            request = {"compare": [compare], "success": [tx.put(k, desired, lease=lease_id)], "failure": [tx.get(k)]}
            won, responses = self._call(lambda c, request=request: c.transaction(**request), "compare_set")
            if won:
                return desired
            if responses[0]:
                return responses[0][0][0]
            if expected != b"":
                return expected  # absent key, non-empty expectation: torch's TCPStore answers so
            # Empty expectation raced with a delete: try again.
