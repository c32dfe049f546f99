"""Assemble client, lease, backend, store and torch's handler from torchrun's parameters."""

from __future__ import annotations

import logging
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from .backend import Etcd3RendezvousBackend, run_key
from .client import (
    EtcdAuthError,
    EtcdClient,
    EtcdError,
    EtcdNotEtcdError,
    EtcdUnavailableError,
)
from .identity import claim_job
from .lease import RunLease
from .options import RendezvousOptions, parse_options
from .signing import StateCodec
from .store import Etcd3Store

log = logging.getLogger(__name__)
_warned_unsigned = False


class Etcd3Parts:
    """The pieces of one etcd3 rendezvous, kept together so tests can close them."""

    def __init__(self, options: RendezvousOptions) -> None:
        self.options = options
        self.client = EtcdClient(options.client)
        self.lease = RunLease(self.client, run_key(options.key_prefix, options.run_id, "lease"), options.ttl)
        self.backend = Etcd3RendezvousBackend(
            self.client, options.run_id, options.key_prefix, self.lease, StateCodec(options.secret, options.run_id)
        )
        self.store = Etcd3Store(self.client, run_key(options.key_prefix, options.run_id, "store/"), self.lease)

    def connect(self) -> None:
        """Join the run's lease now, so an unreachable etcd fails at start, naming the endpoint."""
        try:
            self.lease.id()
        except EtcdError as exc:
            self.close()
            raise RendezvousConnectionError(f"The etcd3 rendezvous cannot start: {exc} {_hint(exc)}") from exc
        self.lease.start_keep_alive()

    def close(self) -> None:
        """Stop the keep-alive and close the channels."""
        self.lease.stop()
        self.store.close()
        self.client.close()


def _hint(exc: EtcdError) -> str:
    """What to check, by what went wrong; a refusal that is not about logins does not blame the password."""
    text = str(exc)
    if isinstance(exc, EtcdNotEtcdError):
        return "Check that --rdzv-endpoint names an etcd v3 server's client URL (port 2379 by default)."
    if isinstance(exc, EtcdUnavailableError):
        if "HTTP/2" in text or "SETTINGS frame" in text:
            return (
                "The server there does not speak gRPC over plain HTTP/2: it is not an etcd client URL, "
                "or it expects TLS. Check --rdzv-endpoint, and the TLS options if etcd uses TLS."
            )
        return "Check --rdzv-endpoint, that etcd is running, and the TLS options if etcd uses TLS."
    if isinstance(exc, EtcdAuthError):
        return "Check the etcd user, its password, and its role's permissions on the key prefix."
    return "The reason etcd gave is quoted above."


def warn_if_unsigned(options: RendezvousOptions) -> None:
    """Log once per process that the state is not signed, and what that leaves open."""
    global _warned_unsigned
    if options.secret is None and not _warned_unsigned:
        _warned_unsigned = True
        log.warning(
            "The etcd3 rendezvous of run '%s' runs without a signing secret: anyone who can write "
            "%s/ in etcd can disturb the rendezvous (states are still type-checked before torch "
            "unpickles them, so no code runs from etcd). Set 'secret_file' on every agent, and "
            "restrict the prefix with etcd's authentication.",
            options.run_id,
            options.key_prefix.rstrip("/"),
        )


def build_parts(params: RendezvousParameters) -> Etcd3Parts:
    """Parse the options and connect; raises ``ValueError`` or ``RendezvousConnectionError``."""
    options = parse_options(params.endpoint, params.run_id, params.config)
    warn_if_unsigned(options)
    parts = Etcd3Parts(options)
    parts.connect()
    return parts


def build_handler(params: RendezvousParameters, share_tcp_store: bool = False) -> RendezvousHandler:
    """The handler ``impl`` names: the etcd-native one, or torch's own on the etcd3 backend and store."""
    parts = build_parts(params)
    claim_job(parts, params)  # one job per run id: refuse another job's run before joining it
    if parts.options.impl == "native":
        from .native import NativeRendezvousHandler

        try:
            handler = NativeRendezvousHandler(
                parts, params.min_nodes, params.max_nodes, params.local_addr, share_tcp_store=share_tcp_store
            )
        except BaseException:
            parts.close()
            raise
        handler.start()  # its lease and its watch now, so a broken etcd fails the agent at start
        return handler
    return _dynamic_handler(parts, params)


def _dynamic_handler(parts: Etcd3Parts, params: RendezvousParameters) -> DynamicRendezvousHandler:
    o = parts.options
    timeout = RendezvousTimeout(
        join=timedelta(seconds=o.join_timeout),
        last_call=timedelta(seconds=o.last_call_timeout),
        close=timedelta(seconds=o.close_timeout),
        heartbeat=timedelta(seconds=o.heartbeat_timeout),
    )
    return DynamicRendezvousHandler.from_backend(
        run_id=o.run_id,
        store=parts.store,
        backend=parts.backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        timeout=timeout,
        keep_alive_interval=o.keep_alive_interval,  # type: ignore[arg-type]  # a float works too
        keep_alive_max_attempt=o.keep_alive_max_attempt,
    )
