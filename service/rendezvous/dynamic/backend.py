"""torch's ``RendezvousBackend`` on the etcd v3 API.

The state lives under ``<key_prefix>/<run_id>/state``; its ``mod_revision`` is
the fencing token, and ``set_state`` is one compare-and-set transaction on it.

Split-brain guard: once the backend has seen the run's state, that key lives
as long as this agent keeps the run's lease alive. If it vanishes afterwards,
or comes back with another ``create_revision`` (deleted and written again by a
new world), or the run's lease is reported missing, someone deleted the run's
keys or revoked its lease. The backend then raises :class:`RunLostError` on
this and every later call. torchrun's monitor loop reads the state through
``num_nodes_waiting()``, so the agent stops its workers and exits non-zero
instead of training next to a second world formed under the same run id.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from service.rendezvous.client import EtcdClient, EtcdError, EtcdUncertainError, LeaseNotFoundError
from service.rendezvous.dynamic.signing import StateCodec, StateIntegrityError
from service.rendezvous.lease import RunLease, RunLostError

_MAX_ATTEMPTS = 20
_RETRY = object()


def run_key(key_prefix: str, run_id: str, leaf: str) -> bytes:
    """The etcd key of ``leaf`` (``state``, ``lease``, ``store/``) of a run."""
    if not run_id:
        raise ValueError("The run id must be a non-empty string.")
    return f"{key_prefix.rstrip('/')}/{run_id}/{leaf}".encode()


def valid_token(token: Token | None) -> int | None:
    """A token this backend issued (a positive int revision), else ``None``."""
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        return None
    return token


class Etcd3RendezvousBackend(RendezvousBackend):
    """Compare-and-set rendezvous state in etcd v3, leased and optionally signed."""

    def __init__(self, client: EtcdClient, run_id: str, key_prefix: str, lease: RunLease, codec: StateCodec) -> None:
        self._client = client
        self._run_id = run_id
        self._key_prefix = key_prefix
        self._key = run_key(key_prefix, run_id, "state")
        self._lease = lease
        self._codec = codec
        self._lease_id_used = 0
        self._created: int | None = None  # create_revision of the state key this agent has seen
        self._lost: RunLostError | None = None

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd3"

    @property
    def key(self) -> bytes:
        """The etcd key that holds the state."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        found = self._read()
        if found is None:
            return None
        blob, revision, _ = found
        return self._decode(blob), revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class. Writes only if ``token`` is the current revision (or ``None`` and no state)."""
        self._check_not_lost()
        if token is not None and valid_token(token) is None:
            return self._current_without_write()
        expected = valid_token(token) or 0
        blob = self._codec.encode(state, self._key)
        for _ in range(_MAX_ATTEMPTS):
            try:
                return self._compare_and_set(blob, state, expected)
            except EtcdUncertainError:
                # The write may have landed: decide by what etcd holds now.
                decided = self._decide_after_uncertain_write(blob, state, expected)
                if decided is not _RETRY:
                    return decided
            except LeaseNotFoundError:
                if self._created is not None:
                    self._lose(f"its lease {self._lease_id_used:x} is gone from etcd (revoked or expired)")
                self._lease.invalidate(self._lease_id_used)
            except EtcdError as exc:
                raise _connection_error(exc) from exc
        raise RendezvousConnectionError(
            f"Writing the rendezvous state to etcd at {self._client.endpoints} failed {_MAX_ATTEMPTS} times in a row."
        )

    def _compare_and_set(self, blob: bytes, state: bytes, expected: int) -> tuple[bytes, Token, bool] | None:
        tx = self._client.raw.transactions
        lease_id = self._lease_id_used = self._lease_id()
        compare = tx.create(self._key) == 0 if expected == 0 else tx.mod(self._key) == expected
        won, responses = self._client.call(
            lambda c: c.transaction(
                compare=[compare],
                success=[tx.put(self._key, blob, lease=lease_id)],
                failure=[tx.get(self._key)],
            ),
            "writing the rendezvous state",
            retry=False,
        )
        if won:
            # The new token is the revision of this very transaction, not a re-read.
            revision = responses[0].response_put.header.revision
            if expected == 0:
                self._observe(revision)  # this transaction created the key
            return state, revision, True
        if not responses[0]:
            self._observe(None)
            return None
        current, meta = responses[0][0]
        self._observe(meta.create_revision)
        return self._decode(current), meta.mod_revision, False

    def _decide_after_uncertain_write(self, blob: bytes, state: bytes, expected: int) -> Any:
        """Return the final answer, or ``_RETRY`` when the precondition still holds."""
        found = self._read()
        if found is None:
            return _RETRY if expected == 0 else None
        current, revision, _ = found
        if current == blob:  # the envelope's nonce makes this our write
            return state, revision, True
        if revision == expected:
            return _RETRY
        return self._decode(current), revision, False

    def _current_without_write(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        return None if current is None else (*current, False)

    def _read(self) -> tuple[bytes, int, int] | None:
        """(envelope, mod_revision, create_revision) of the state key, or ``None``; checks for a lost run."""
        self._check_not_lost()
        try:
            value, meta = self._client.call(lambda c: c.get(self._key), "reading the rendezvous state")
        except EtcdError as exc:
            raise _connection_error(exc) from exc
        if value is None:
            self._observe(None)
            return None
        self._observe(meta.create_revision)
        return value, meta.mod_revision, meta.create_revision

    # -- split-brain guard ------------------------------------------------------
    @property
    def lost(self) -> RunLostError | None:
        """The error that ended this agent's part in the run, once its keys or lease vanished."""
        return self._lost

    def _observe(self, create_revision: int | None) -> None:
        """Remember the state key's incarnation; raise when it is gone or another one replaced it."""
        if self._created is None:
            if create_revision is not None:
                self._created = create_revision
            return
        if create_revision is None:
            self._lose(f"its state key {self._key.decode()} was deleted")
        elif create_revision != self._created:
            self._lose(
                f"its state key {self._key.decode()} was deleted and written again by another agent "
                f"(created at revision {create_revision}, this agent joined the one created at {self._created})"
            )

    def _lose(self, what: str) -> None:
        self._lost = RunLostError(
            f"The rendezvous run '{self._run_id}' is gone from etcd: {what} while this agent was part of it, "
            "so the run's keys were deleted or its lease revoked. This agent stops its workers and exits to "
            "avoid a split brain, a second world training under the same run id. Do not delete a live run's "
            "keys with etcdctl; to reuse a run id, let its job finish and then run "
            f"'ddp-service rdzv retire --endpoint HOST:PORT --prefix {self._key_prefix} {self._run_id}'."
        )
        raise self._lost

    def _check_not_lost(self) -> None:
        if self._lost is not None:
            raise RunLostError(str(self._lost))

    def _lease_id(self) -> int:
        try:
            return self._lease.id()
        except EtcdError as exc:
            raise _connection_error(exc) from exc

    def _decode(self, blob: bytes) -> bytes:
        try:
            return self._codec.decode(blob, self._key)
        except StateIntegrityError as exc:
            raise RendezvousStateError(str(exc)) from exc


def _connection_error(exc: Any) -> RendezvousConnectionError:
    return RendezvousConnectionError(f"The etcd3 rendezvous backend cannot use etcd: {exc}")
