"""A lease refresh's cost: a new LeaseKeepAlive stream per refresh (pyetcd's ``refresh_lease``, what the
rendezvous did before) against one stream kept open (``EtcdClient.refresh_lease``, service/rendezvous/keepalive.py).

Both refresh the same lease of a fresh local etcd through one client, in
alternating blocks (ABAB), and report the process's CPU and the wall time per
refresh, medians over the blocks, and their ratio. The process CPU counts
gRPC's own threads (a stream per refresh starts a thread to feed it), which is
what a simulated node's keep-alives take from the machine at a mass start.

    python bench/keepalive.py [--blocks 6] [--per-block 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one
sys.path.insert(0, str(REPO / "bench"))

from rendezvous_scale import start_etcd  # noqa: E402

from service.rendezvous.client import EtcdClient  # noqa: E402
from service.rendezvous.options import ClientOptions, parse_endpoints  # noqa: E402


def block(refresh: Callable[[], int], count: int) -> tuple[float, float]:
    """CPU seconds (the whole process) and wall seconds per refresh over ``count`` refreshes."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(count):
        if refresh() <= 0:
            raise SystemExit("etcd lost the bench's lease")
    return (time.process_time() - cpu) / count, (time.perf_counter() - wall) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each kind, alternating")
    parser.add_argument("--per-block", type=int, default=300, help="refreshes per block")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        etcd = start_etcd(Path(tmp))
        try:
            client = EtcdClient(ClientOptions(parse_endpoints(etcd.endpoint), 1.0, 0.0, 0.0))
            lease = client.call(lambda c: c.lease(60).id, "granting the bench's lease")
            kinds: dict[str, Callable[[], int]] = {
                "stream per refresh": lambda: int(list(client.raw.refresh_lease(lease))[0].TTL),
                "one stream kept open": lambda: client.refresh_lease(lease, "refreshing the bench's lease"),
            }
            rows: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
            for refresh in kinds.values():  # warm both up: channels, threads, the first stream
                block(refresh, 20)
            for index in range(args.blocks * 2):
                name = list(kinds)[index % 2]
                rows[name].append(block(kinds[name], args.per_block))
            client.close()
        finally:
            etcd.kill()
    print(f"lease refreshes, {args.blocks} blocks of {args.per_block} each, alternating; medians per refresh")
    print(f"{'':<22}{'CPU ms':>9}{'wall ms':>9}")
    medians = {name: [statistics.median(r[i] for r in rows[name]) * 1e3 for i in (0, 1)] for name in rows}
    for name, (cpu, wall) in medians.items():
        print(f"{name:<22}{cpu:>9.3f}{wall:>9.3f}")
    (old_cpu, old_wall), (new_cpu, new_wall) = medians.values()
    print(f"ratio (per refresh / kept open): CPU {old_cpu / new_cpu:.1f}x, wall {old_wall / new_wall:.1f}x")


if __name__ == "__main__":
    main()
