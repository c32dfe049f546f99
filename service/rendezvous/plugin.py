"""The ``torchrun.handlers`` entry point that registers ``--rdzv-backend=etcd3``.

torch calls :func:`entrypoint` while ``torch.distributed.elastic.rendezvous`` is
still importing (its ``__init__`` runs the registration). Importing torch's
rendezvous modules here at top level would be a circular import, and torch
would only log a warning and leave ``etcd3`` unregistered. So this module
imports nothing of torch, and the creator imports the backend lazily.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

BACKEND_NAME = "etcd3"


def entrypoint() -> Callable[[Any], Any]:
    """What torch loads from the entry point: returns the handler creator."""
    return create_rendezvous_handler


def create_rendezvous_handler(params: Any) -> Any:
    """Build the etcd3 handler (``impl``: native or torch's dynamic one) from torchrun's ``RendezvousParameters``."""
    # torch shares the agent's rendezvous TCPStore with the workers by default.
    # Across restarts that breaks: when the node of rank 0 dies the survivors
    # keep its dead address, and restarted workers read stale gloo addresses
    # and hang. With sharing off, worker rank 0 hosts a fresh TCPStore on every
    # restart, at an address the rendezvous publishes in etcd. An explicit
    # setting by the user wins.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    share = os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] != "1"  # read once, as torch's own handler reads it
    from service.rendezvous.factory import build_handler
    from service.rendezvous.options import scrub_secret_env

    try:
        return build_handler(params, share_tcp_store=share)
    finally:
        # The agent hands its environment to every worker: once the options are read,
        # the variables named by password_env and secret_env leave it, success or not.
        scrub_secret_env(params.config)
