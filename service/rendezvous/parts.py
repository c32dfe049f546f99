"""The pieces of one etcd3 rendezvous (client, run lease, backend, store), built by the factory and
handed to either handler.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from service.rendezvous.client import EtcdAuthError, EtcdClient, EtcdError, EtcdNotEtcdError, EtcdUnavailableError
from service.rendezvous.dynamic.backend import Etcd3RendezvousBackend, run_key
from service.rendezvous.dynamic.signing import StateCodec
from service.rendezvous.lease import RunLease
from service.rendezvous.options import RendezvousOptions
from service.rendezvous.store import Etcd3Store


class Etcd3Parts:
    """The pieces of one etcd3 rendezvous, kept together so tests can close them."""

    def __init__(self, options: RendezvousOptions) -> None:
        self.options = options
        # A start retries an etcd that is there but slow (a mass start) until join_timeout (retry.py).
        self.client = EtcdClient(dataclasses.replace(options.client, start_timeout=options.join_timeout))
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
