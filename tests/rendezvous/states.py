"""Real torch rendezvous states as bytes, since the backend refuses anything else.

The backend type-checks every state with a restricted unpickler before torch
sees it, so tests write what torch's handler writes: a pickled
``_RendezvousState``, here with every field filled.
"""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _NodeDesc,
    _RendezvousState,
)


def state_bytes(tag: str = "state", round_no: int = 0, protocol: int | None = None) -> bytes:
    """A full ``_RendezvousState`` whose node addresses carry ``tag``, pickled as torch pickles it."""
    state = _RendezvousState()
    state.round = round_no
    first, second, third = (_NodeDesc(f"{tag}-{i}", 1000 + i, i) for i in range(3))
    state.participants = {first: 0, second: 1}
    state.wait_list = {third}
    state.redundancy_list = {second}
    now = datetime(2024, 1, 2, 3, 4, 5, 678)
    state.last_heartbeats = {first: now, second: now.replace(tzinfo=timezone.utc)}
    state.deadline = now + timedelta(seconds=30)
    state.complete = True
    return pickle.dumps(state) if protocol is None else pickle.dumps(state, protocol=protocol)


def tag_of(state: bytes) -> str:
    """The ``tag`` a ``state_bytes`` state was made with."""
    loaded = pickle.loads(state)  # test-only: these bytes come from state_bytes
    return min(node.addr for node in loaded.participants).rsplit("-", 1)[0]
