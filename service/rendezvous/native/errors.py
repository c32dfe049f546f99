"""The native handler's liveness timeout and its errors, worded for the operator."""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from service.rendezvous.lease import RunLostError


def node_lease_ttl(keep_alive_interval: float, keep_alive_max_attempt: int) -> int:
    """The node lease's TTL: the liveness timeout, in whole seconds, at least etcd's 2 s minimum."""
    return max(2, math.ceil(keep_alive_interval * keep_alive_max_attempt))


def lost_error(run_id: str, key_prefix: str, what: str) -> RunLostError:
    """This node's part in the run is over (``what`` happened); it must not join a second world."""
    return RunLostError(
        f"The rendezvous run '{run_id}' is gone for this node: {what} while it was part of the run "
        "(its lease expired while the agent stalled, or the lease was revoked, or the run's keys were "
        "deleted). This agent stops its workers and exits to avoid a split brain, a second world training "
        "under the same run id. To reuse a run id, let its job finish and then run "
        f"'ddp-service rdzv retire --endpoint HOST:PORT --prefix {key_prefix} {run_id}'."
    )


def closed_error(run_id: str) -> RendezvousClosedError:
    return RendezvousClosedError(
        f"The rendezvous '{run_id}' is closed: its job has finished. Use a new --rdzv-id, or "
        "retire the run with 'ddp-service rdzv retire' (or wait out the run's ttl) to use this one again."
    )


def connection_error(exc: BaseException) -> RendezvousConnectionError:
    return RendezvousConnectionError(f"The etcd3 rendezvous cannot use etcd: {exc}")


def join_timeout_error(
    run_id: str, join_timeout: float, round_no: int, min_nodes: int, view: Any
) -> RendezvousTimeoutError:
    """Round ``round_no`` was not sealed within the join timeout; ``view`` (a ``RoundView``) says why, if known."""
    if view is None:  # not a sealer: it has no copy of the round
        joined = "too few nodes joined it"
    else:
        joined = (
            f"{len(view.joined)} node(s) joined it, at least {min_nodes} are needed (and {view.earlier} node(s) "
            "of the previous round have not moved on yet)"
        )
    return RendezvousTimeoutError(
        f"The rendezvous '{run_id}' did not complete within the join timeout of {join_timeout:g} s: round "
        f"{round_no} was not sealed; {joined}."
    )
