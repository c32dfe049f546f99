"""A port for rank 0's store that no outgoing connection can take before rank 0 listens on it.

Without a shared agent store (the etcd3 rendezvous's default) rank 0's agent picks the port at the
rendezvous and its worker listens on it seconds later, after its imports. torch's ``get_free_port``
binds port 0 and closes the socket, so the port comes from the kernel's ephemeral range: the range it
also hands out as the local port of every outgoing connection. In those seconds any connection on the
machine (a gloo mesh, a gRPC channel to etcd) may take it, and rank 0's TCPStore fails with EADDRINUSE.
A port below that range is never handed out implicitly; only a listener choosing the same number could
take it, and a bind checks that the moment it is chosen.

The same holds for any port chosen now and listened on later (a metrics endpoint, a test's etcd), and for a
port connected to before anything listens on it: a connection to an ephemeral port on this host can be given
that very port as its own local one and connect to itself (a scrape then reads back its own request).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_RANGE = (32768, 60999)
LOWEST = 20000  # above the ports services usually claim (etcd 2379/2380, Prometheus 9090, Slurm 6817-6819)
_TRIES = 64


def ephemeral_range(source: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for implicitly bound local ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in source.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_RANGE
    return (low, high) if 0 < low <= high <= 65535 else LINUX_DEFAULT_RANGE


def candidate_ranges(low: int, high: int) -> list[range]:
    """The ports outside ``[low, high]``, at or above :data:`LOWEST`."""
    ranges = [range(LOWEST, low), range(max(LOWEST, high + 1), 65536)]
    return [r for r in ranges if len(r) > 0]


def can_listen(port: int) -> bool:
    """Whether a listener on every address could take ``port`` now (as rank 0's TCPStore will)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _nth(ranges: list[range], index: int) -> int:
    for span in ranges:
        if index < len(span):
            return span[index]
        index -= len(span)
    raise IndexError(index)


def listen_ports(count: int = 1, rng: random.Random | None = None, source: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A port p such that p .. p+count-1 are free to listen on now, all outside the ephemeral range.

    For one port, torch's choice (an ephemeral one) if no candidate is free; for several, an error.
    """
    if count < 1:
        raise ValueError(f"count={count}: ask for at least one port.")
    rng = rng or random.SystemRandom()
    bases = [range(span.start, span.stop - count + 1) for span in candidate_ranges(*ephemeral_range(source))]
    bases = [span for span in bases if len(span) > 0]
    total = sum(len(span) for span in bases)
    for _ in range(_TRIES if total else 0):
        base = _nth(bases, rng.randrange(total))
        if all(can_listen(port) for port in range(base, base + count)):
            return base
    if count > 1:
        low, high = ephemeral_range(source)
        raise RuntimeError(f"No {count} consecutive free ports from {LOWEST} up outside the ephemeral range "
                           f"{low}-{high}; free some ports, or ask for fewer.")  # fmt: skip
    from torch.distributed.elastic.utils.distributed import get_free_port  # every candidate taken: torch's way

    return int(get_free_port())


def listen_port(rng: random.Random | None = None, source: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A port free to listen on now and outside the ephemeral range; an ephemeral one if none is found."""
    return listen_ports(1, rng, source)
