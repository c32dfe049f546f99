"""Assemble client, lease, backend, store and torch's handler from torchrun's parameters."""

from __future__ import annotations

import logging
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from service.rendezvous.identity import claim_job
from service.rendezvous.options import RendezvousOptions, parse_options
from service.rendezvous.parts import Etcd3Parts

log = logging.getLogger(__name__)
_warned_unsigned = False


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
        from service.rendezvous.native.handler import NativeRendezvousHandler

        try:
            handler = NativeRendezvousHandler(
                parts, params.min_nodes, params.max_nodes, params.local_addr, share_tcp_store=share_tcp_store
            )
        except BaseException:
            parts.close()
            raise
        handler.start()  # its lease and its watch now, so a broken etcd fails the agent at start
        parts.client.end_start()  # from now on a failing etcd gets the grace window
        return handler
    dynamic = _dynamic_handler(parts, params)
    parts.client.end_start()
    return dynamic


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
