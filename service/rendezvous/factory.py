"""Assemble client, lease, backend, store and torch's handler from torchrun's parameters."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from .backend import Etcd3RendezvousBackend, run_key
from .client import EtcdClient, EtcdError, EtcdUnavailableError
from .lease import RunLease
from .options import RendezvousOptions, parse_options
from .signing import StateCodec
from .store import Etcd3Store


class Etcd3Parts:
    """The pieces of one etcd3 rendezvous, kept together so tests can close them."""

    def __init__(self, options: RendezvousOptions) -> None:
        self.options = options
        self.client = EtcdClient(options.client)
        self.lease = RunLease(self.client, run_key(options.key_prefix, options.run_id, "lease"), options.ttl)
        self.backend = Etcd3RendezvousBackend(
            self.client, options.run_id, options.key_prefix, self.lease, StateCodec(options.secret)
        )
        self.store = Etcd3Store(self.client, run_key(options.key_prefix, options.run_id, "store/"), self.lease)

    def connect(self) -> None:
        """Join the run's lease now, so an unreachable etcd fails at start, naming the endpoint."""
        try:
            self.lease.id()
        except EtcdError as exc:
            self.close()
            if isinstance(exc, EtcdUnavailableError):
                hint = "Check --rdzv-endpoint, that etcd is running, and the TLS options if etcd uses TLS."
            else:
                hint = "Check the etcd user, its password, and its role's permissions on the key prefix."
            raise RendezvousConnectionError(f"The etcd3 rendezvous cannot start: {exc} {hint}") from exc
        self.lease.start_keep_alive()

    def close(self) -> None:
        """Stop the keep-alive and close the channels."""
        self.lease.stop()
        self.client.close()


def build_parts(params: RendezvousParameters) -> Etcd3Parts:
    """Parse the options and connect; raises ``ValueError`` or ``RendezvousConnectionError``."""
    options = parse_options(params.endpoint, params.run_id, params.config)
    parts = Etcd3Parts(options)
    parts.connect()
    return parts


def build_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's own handler, driving the etcd3 backend and store."""
    parts = build_parts(params)
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
