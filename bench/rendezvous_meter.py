"""What bench/rendezvous_scale.py measures besides time: etcd's own counters, the watch traffic each watcher
receives, the machine's memory and load.

* ``etcd_metrics``: etcd's Prometheus counters from its client URL (``/metrics``): watch events sent
  (``etcd_debugging_mvcc_events_total``), gRPC bytes sent to clients, live watchers and watch streams,
  leases granted and expired.
* ``count_watch_traffic``: counts, in this process, the events and the bytes of every watch response that
  pyetcd's ``Watcher`` receives, per ``Watcher`` (one per handler unless its watch was rebuilt).
* ``MemoryGuard``: the lowest ``MemAvailable`` seen, and whether it fell below a floor (then the point stops
  rather than take the machine down).
"""

from __future__ import annotations

import os
import resource
import threading
import time
import urllib.request
from collections import defaultdict
from typing import Any

METRICS = {
    "events": "etcd_debugging_mvcc_events_total",
    "sent_bytes": "etcd_network_client_grpc_sent_bytes_total",
    "watchers": "etcd_debugging_mvcc_watcher_total",
    "watch_streams": "etcd_debugging_mvcc_watch_stream_total",
    "leases_granted": "etcd_debugging_lease_granted_total",
    "leases_expired": "etcd_debugging_server_lease_expired_total",
    "slow_watchers": "etcd_debugging_mvcc_slow_watcher_total",
}


def etcd_metrics(endpoint: str) -> dict[str, float]:
    """etcd's counters of ``METRICS`` (0 for one it does not export)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return {short: values.get(full, 0.0) for short, full in METRICS.items()}


def count_watch_traffic() -> dict[int, list[int]]:
    """Patch pyetcd's Watcher to count [events, bytes] per watcher object; returns the live table."""
    from pyetcd import watch

    table: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    lock = threading.Lock()
    handle = watch.Watcher._handle_response

    def counted(self: Any, rs: Any) -> Any:
        with lock:
            row = table[id(self)]
            row[0] += len(rs.events)
            row[1] += rs.ByteSize()
        return handle(self, rs)

    watch.Watcher._handle_response = counted  # type: ignore[method-assign]
    return table


def raise_nofile() -> int:
    """Raise this process's soft limit of open files to its hard limit (children inherit it); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_of(pid: int) -> int:
    """Resident bytes of process ``pid`` (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemoryGuard:
    """Samples MemAvailable (and etcd's resident size) in a thread; ``low`` is set below ``floor`` bytes."""

    def __init__(self, floor: int, etcd_pid: int | None = None, every: float = 0.5) -> None:
        self.floor, self.etcd_pid, self.every = floor, etcd_pid, every
        self.lowest = mem_available()
        self.etcd_peak = 0
        self.low = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            available = mem_available()
            self.lowest = min(self.lowest, available)
            if self.etcd_pid:
                self.etcd_peak = max(self.etcd_peak, rss_of(self.etcd_pid))
            if available < self.floor:
                self.low.set()


def conditions() -> dict[str, Any]:
    """The machine's state, for the report: load averages, CPUs, memory available."""
    return {
        "load": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "mem_available_gib": round(mem_available() / 2**30, 1),
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
