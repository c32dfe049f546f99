"""A pyetcd client that survives what a long training run meets.

pyetcd alone makes one etcd error fatal to the torchrun agent: the agent polls
the rendezvous every 0.1 s, and a 3-second etcd restart ended a whole job.
This wrapper gives every call

* a deadline (``read_timeout``) on each RPC, so nothing hangs, and a request
  to a frozen member fails in time to be retried on the next one;
* fail-over between endpoints;
* retries inside a grace window that opens at the first error after a success,
  so an etcd restart or a lost cluster member does not stop the job, while an
  etcd that was never reachable fails within ``read_timeout`` per endpoint;
* at start, an etcd that is there but slow (a mass start: hundreds of agents
  connecting at once; a cluster still electing its leader) is retried with
  backoff until ``start_timeout`` (the rendezvous's ``join_timeout``), each
  request still bounded by ``read_timeout``; nothing listening, a server that
  does not speak HTTP/2, or a TLS refusal still fail at once;
* re-authentication, since etcd's tokens do not survive a restart or a move to
  another member.

pyetcd marks an endpoint failed for 300 s after one UNAVAILABLE and then raises
``ValueError('Trying to use a failed node')`` without trying; the retry time is
set to ``failed_node_retry`` and that error is treated as transient too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from service.rendezvous.keepalive import KeepAlive
from service.rendezvous.options import ClientOptions
from service.rendezvous.requests import RangeRead, WatchSpec
from service.rendezvous.retry import TRANSIENT_DETAILS, RetryWindow, keep_trying
from service.rendezvous.watchstream import WatchStream

log = logging.getLogger(__name__)

T = TypeVar("T")

# Reconnect quickly after etcd comes back; gRPC's default backoff grows to 120 s. gRPC core reads
# "min_reconnect_backoff_ms" as the shortest time one connection attempt is given (its connect timeout), not as
# a pause: at 100 ms, the TCP and HTTP/2 handshake with an etcd busy with a mass start never completed ("connection
# attempt timed out before receiving SETTINGS frame", "tcp handshaker shutdown"), and every agent dialled again.
# An attempt may take 20 s (gRPC's own default); each request keeps its read_timeout deadline, and the attempt
# goes on behind it, so a later try finds the connection made.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 20_000),
    ("grpc.enable_retries", 0),
]
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_TRANSIENT_ERRORS = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)


class EtcdError(Exception):
    """etcd refused a request for a reason that retrying will not fix."""


class EtcdUnavailableError(EtcdError):
    """etcd could not be reached within the time allowed."""


class EtcdUncertainError(EtcdError):
    """One attempt failed in a way that may or may not have applied a write."""


class LeaseNotFoundError(EtcdError):
    """A write named a lease that etcd no longer has."""


class EtcdAuthError(EtcdError):
    """etcd refused a login, or the user lacks permission for the request."""


_COMPACTED_REREADS = 5  # reads of several ranges at one revision, each overtaken by a compaction, before giving up


class WatchCompactedError(EtcdError):
    """A watch asked for revisions that etcd has already compacted away: read afresh and watch again."""


class EtcdNotEtcdError(EtcdError):
    """The endpoint answers gRPC but does not know etcd's API: it is some other server."""


# etcd answers these to a request without a valid login (with auth on) or without the
# role's permission; anything else is not about the user or its password.
_AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_AUTH_DETAILS = ("user name is empty", "invalid auth token", "authentication failed", "permission denied")


def is_failed_node_error(exc: BaseException) -> bool:
    """pyetcd's way of saying an endpoint is in its failed-retry period."""
    return isinstance(exc, ValueError) and "failed node" in str(exc)


class EtcdClient:
    """Thread-safe access to etcd with deadlines, fail-over and a grace window."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self._lock = threading.RLock()
        self.window = RetryWindow(options)
        self._warned_at = 0.0
        self._need_auth = options.user is not None
        self._client = self._build()
        self._keep_alive = KeepAlive(options.read_timeout)

    @property
    def endpoints(self) -> str:
        """The configured endpoints, for messages."""
        return self.options.describe_endpoints()

    @property
    def raw(self) -> pyetcd.MultiEndpointEtcd3Client:
        """The underlying pyetcd client (for its ``transactions`` helpers)."""
        return self._client

    def end_start(self) -> None:
        """The start is over (the agent is connected and in the run): from now on the grace window applies."""
        self.window.end_start()

    def close(self) -> None:
        """Close the lease keep-alive stream and the gRPC channels."""
        self._keep_alive.close()
        try:
            self._client.close()
        except Exception:  # closing is best effort
            log.debug("Closing the etcd client failed.", exc_info=True)

    def list_prefix(self, prefix: bytes, what: str) -> tuple[int, list[Any]]:
        """(revision, key-values) of every key under ``prefix``, read at one revision."""
        response = self.call(lambda c: c.get_prefix_response(prefix), what)
        return int(response.header.revision), list(response.kvs)

    def refresh_lease(self, lease_id: int, what: str) -> int:
        """Refresh a lease once, on this client's keep-alive stream; its TTL after the refresh, 0 if etcd lacks it."""
        return self.call(lambda c: self._keep_alive.refresh(c, lease_id), what)

    def delete_if_value(self, key: bytes, value: bytes, what: str) -> bool:
        """Delete ``key`` only while it still holds exactly ``value``; whether it was deleted."""
        tx = self._client.transactions
        deleted, _ = self.call(
            lambda c: c.transaction(compare=[tx.value(key) == value], success=[tx.delete(key)], failure=[]), what
        )
        return bool(deleted)

    def txn(self, request: Any, what: str, retry: bool = True) -> Any:
        """Send a transaction built from etcd's messages (``requests.txn_request``); etcd's ``TxnResponse``."""
        return self.call(
            lambda c: c.kvstub.Txn(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata),
            what,
            retry=retry,
        )

    def read_ranges(self, reads: Sequence[RangeRead], what: str) -> tuple[int, list[list[Any]]]:
        """Every read at one revision: (that revision, the key-values of each read).

        Range requests, the first one's revision pinned for the others, never a read-only transaction: etcd 3.5.0
        and 3.5.1 panic and exit when a read-only transaction runs out of its deadline (fixed in 3.5.2), which a
        busy etcd meets in a mass start. A compaction past the pinned revision between two of them (etcd's own
        periodic one, or an operator's) refuses the later ones as compacted: they are all read again, from a new
        first read.
        """

        def op(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[int, list[list[Any]]]:
            attempt = 0
            while True:
                try:
                    return _ranges_at_one_revision(c, reads)
                except grpc.RpcError as exc:  # (only a pinned read can be refused as compacted)
                    attempt += 1
                    if attempt == _COMPACTED_REREADS or _code_and_details(exc)[0] != grpc.StatusCode.OUT_OF_RANGE:
                        raise

        return self.call(op, what)

    def count(self, read: RangeRead, what: str) -> int:
        """How many keys ``read`` covers."""
        request = dataclasses.replace(read, count_only=True).request()
        response = self.call(
            lambda c: c.kvstub.Range(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata), what
        )
        return int(response.count)

    def open_watch_stream(
        self,
        watches: Sequence[tuple[Hashable, WatchSpec]],
        on_response: Callable[[Hashable, Any], None],
        on_end: Callable[[BaseException | None], None],
        what: str,
        meter: list[int] | None = None,
    ) -> WatchStream:
        """A new watch stream with ``watches`` (tag and spec each), once etcd confirmed them all.

        A stream of its own carries the current login token and channel, so one made after a re-login or a
        fail-over works. More watches are added to it later without waiting (``WatchStream.create``).
        """

        def create(c: pyetcd.MultiEndpointEtcd3Client) -> WatchStream:
            # "hasleader": etcd ends the watch when its member loses the leader (no quorum), instead of
            # leaving it open and silent, so a watcher learns of an outage as a client with requests does.
            metadata = (*(c.metadata or ()), ("hasleader", "true"))
            stub = pyetcd.etcdrpc.WatchStub(c.channel)
            stream = WatchStream(stub, metadata, c.call_credentials, on_response, on_end, meter)
            try:
                for tag, spec in watches:
                    stream.create(tag, spec)
                refused = stream.confirmed([tag for tag, _ in watches], time.monotonic() + self.options.read_timeout)
            except TimeoutError as exc:
                stream.close()
                raise etcd_exc.WatchTimedOut(str(exc)) from exc
            except BaseException:
                stream.close()
                raise
            if refused:
                stream.close()
                response = next(iter(refused.values()))
                if response.compact_revision:
                    raise WatchCompactedError(f"revision {response.compact_revision} and older are compacted")
                raise EtcdError(f"etcd at {self.endpoints} refused a watch: {response.cancel_reason or 'no reason'}.")
            return stream

        return self.call(create, what)

    def call(self, op: Callable[[pyetcd.MultiEndpointEtcd3Client], T], what: str, retry: bool = True) -> T:
        """Run ``op`` against etcd; retry transient errors inside the grace window.

        With ``retry=False`` a transient failure raises ``EtcdUncertainError``
        after one attempt, for writes whose outcome must be checked by a read.
        """
        if not retry:
            result = self._attempt(op)
            self.window.ok()
            return result
        try:
            warn = lambda left: self._warn_slow_start(what, left)  # noqa: E731
            return keep_trying(lambda: self._attempt(op), self.window, EtcdUncertainError, warn)
        except EtcdUncertainError as exc:
            last = self.window.last_error or exc.__cause__
            raise EtcdUnavailableError(self._unavailable_message(what, last)) from exc.__cause__

    def _attempt(self, op: Callable[[pyetcd.MultiEndpointEtcd3Client], T]) -> T:
        """One try; transient failures come out as ``EtcdUncertainError``."""
        try:
            with self._lock:
                if self._need_auth:
                    self._authenticate()
            return op(self._client)
        except _TRANSIENT_ERRORS as exc:
            if isinstance(exc, etcd_exc.NoServerAvailableError):
                self.window.failed()
            else:
                self.window.failed(_describe(exc), timed_out=isinstance(exc, etcd_exc.ConnectionTimeoutError))
            raise EtcdUncertainError(str(exc)) from exc
        except etcd_exc.WatchTimedOut as exc:
            self.window.failed(timed_out=True)
            raise EtcdUncertainError(f"creating a watch timed out: {exc}") from exc
        except ValueError as exc:
            if not is_failed_node_error(exc):
                raise
            self.window.failed()
            raise EtcdUncertainError(str(exc)) from exc
        except grpc.RpcError as exc:
            raise self._classify(exc) from exc

    def _classify(self, exc: grpc.RpcError) -> EtcdError:
        code, details = _code_and_details(exc)
        if code in _TRANSIENT_CODES or any(d in details for d in TRANSIENT_DETAILS):
            # Raw errors (authentication, lease streams) skip pyetcd's own bookkeeping.
            self._fail_current_endpoint()
            error = f"{code.name}: {details}"
            self.window.failed(error, timed_out=code == grpc.StatusCode.DEADLINE_EXCEEDED)
            return EtcdUncertainError(error)
        if code == grpc.StatusCode.UNAUTHENTICATED and self.options.user is not None:
            # Tokens are per member and lost on restart: log in again, then retry.
            self._need_auth = True
            self.window.failed()
            return EtcdUncertainError(f"the etcd auth token was refused ({details})")
        if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
            return LeaseNotFoundError(details)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return EtcdNotEtcdError(
                f"The server at {self.endpoints} is not an etcd v3 server: it answers gRPC but does not "
                f"know etcd's API ({code.name}: {details})."
            )
        message = f"etcd at {self.endpoints} refused the request: {code.name}: {details}."
        if code in _AUTH_CODES or any(d in details.lower() for d in _AUTH_DETAILS):
            return EtcdAuthError(message)
        return EtcdError(message)

    def _authenticate(self) -> None:
        request = pyetcd.etcdrpc.AuthenticateRequest(name=self.options.user, password=self.options.password)
        try:
            response = self._client.authstub.Authenticate(request, self.options.read_timeout)
        except grpc.RpcError as exc:
            code, details = _code_and_details(exc)
            if code in _TRANSIENT_CODES:
                raise
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise self._classify(exc) from exc
            raise EtcdAuthError(
                f"etcd at {self.endpoints} refused the login of user '{self.options.user}': {details}."
            ) from exc
        # Metadata works on plain and TLS channels; call credentials only on TLS.
        self._client.metadata = (("token", response.token),)
        self._need_auth = False

    def _fail_current_endpoint(self) -> None:
        try:
            self._client.endpoint_in_use.fail()
        except Exception:  # bookkeeping only
            pass

    def unreachable_within(self, seconds: float) -> bool:
        """Whether a request went unanswered (etcd down, frozen or cut off) now or in the last ``seconds``.

        The native handler asks this when its node's key vanished: if etcd was not answering meanwhile, the
        lease expired through no act of anyone who could reach etcd (a frozen etcd expires every lease once
        its clock runs on), and the node rejoins instead of leaving the run.
        """
        return self.window.unreachable_within(seconds)

    def _warn_slow_start(self, what: str, remaining: float) -> None:
        """Say, every 10 s at most, that a start waits for a slow etcd (a mass start), and for how long still."""
        now = time.monotonic()
        if self.window.extended and now - self._warned_at >= 10:
            self._warned_at = now
            log.warning(
                "etcd at %s answers slowly (%s failed: %s); retrying with backoff for up to %.0f s more "
                "(join_timeout).", self.endpoints, what, self.window.last_error or "no answer", remaining,
            )  # fmt: skip

    def _unavailable_message(self, what: str, cause: BaseException | str | None) -> str:
        return (
            f"etcd at {self.endpoints} is unreachable; {what} failed and was retried for "
            f"{self.window.waited():g} s (last error: {cause or 'unknown'})."
        )

    def _build(self) -> pyetcd.MultiEndpointEtcd3Client:
        credentials = self._tls_credentials()
        endpoints = [
            pyetcd.Endpoint(
                e.host,
                e.port,
                secure=credentials is not None,
                creds=credentials,
                time_retry=self.options.failed_node_retry,
                opts=_GRPC_OPTIONS,
            )
            for e in self.options.endpoints
        ]
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=endpoints, timeout=self.options.read_timeout, failover=True)
        # pyetcd starts on a random endpoint; start on the first listed, like etcdctl.
        client._current_endpoint_label = endpoints[0].netloc
        return client

    def _tls_credentials(self) -> grpc.ChannelCredentials | None:
        opts = self.options
        if opts.cacert is None:
            return None
        # gRPC takes any bytes here and fails only at the handshake, as if etcd were
        # unreachable; a file that is not PEM at all is refused now, by name.
        ca = _read_pem(opts.cacert, "cacert", b"-----BEGIN CERTIFICATE-----")
        cert = None if opts.cert is None else _read_pem(opts.cert, "cert", b"-----BEGIN CERTIFICATE-----")
        key = None if opts.key is None else _read_pem(opts.key, "key", b"PRIVATE KEY-----")
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read_pem(path: str, option: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"The TLS file '{path}' given as '{option}' cannot be read: {exc.strerror}.") from exc
    if marker not in data:
        what = "private key" if option == "key" else "certificate"
        raise ValueError(f"The TLS file '{path}' given as '{option}' holds no PEM {what}.")
    return data


def _describe(exc: BaseException) -> str:
    """pyetcd's error, with gRPC's reason (a failed TLS handshake, say) that pyetcd drops."""
    context = exc.__context__
    if isinstance(context, grpc.RpcError):
        code, details = _code_and_details(context)
        return f"{exc}: {code.name}: {details}"
    return str(exc)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (a range's end, for compares and deletes)."""
    data = bytearray(prefix)
    for i in reversed(range(len(data))):
        if data[i] < 0xFF:
            data[i] += 1
            return bytes(data[: i + 1])
    return b"\x00"


def _ranges_at_one_revision(
    c: pyetcd.MultiEndpointEtcd3Client, reads: Sequence[RangeRead]
) -> tuple[int, list[list[Any]]]:
    """Each read as one Range request, the first one's revision pinned for the others."""
    revision, found = 0, []
    for read in reads:
        request = read.request()
        if revision:
            request.revision = revision
        response = c.kvstub.Range(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
        revision = revision or int(response.header.revision)
        found.append(list(response.kvs))
    return revision, found


def _code_and_details(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code, details or ""
