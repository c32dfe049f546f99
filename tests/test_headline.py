"""The product's headline, run as written: ``torchrun --nnodes=2 --nproc_per_node=4 -m service train``.

Two torchrun agents ("nodes") on 127.0.0.2 and 127.0.0.3 make a world of 8 CPU processes, once through
torch's c10d rendezvous (torchrun itself: 8 worker interpreters) and once through this package's etcd3
rendezvous with a real etcd, as ``ddp-service launch --nnodes=2 --nproc-per-node=4 --rdzv-backend=etcd3``
(the same torchrun agent, its workers forked from a fork server: 2 imports of torch instead of 8; the etcd3
rendezvous under plain torchrun is tests/rendezvous/test_e2e.py's). A tiny model and a few steps; each run
must complete with world size 8, a TensorBoard dir for every rank and one summary.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from rendezvous.agents import Agent
from rendezvous.conftest import free_port, require_etcd, start_single

pytestmark = pytest.mark.e2e

NNODES, NPROC, STEPS = 2, 4, 4


def job(run_dir: Path) -> list[str]:
    # logging.all_ranks: each node's log holds its own ranks' "done:" lines (rank 0 alone logs INFO otherwise)
    overrides = (f"run_dir={run_dir}", f"train.max_steps={STEPS}", "train.epochs=100", "train.batch_size=2",
                 "task_options.image_size=16", "task_options.train_size=64", "task_options.eval_size=16",
                 "train.progress_bar=false", "train.log_every=2", "checkpoint.every_steps=0",
                 "metrics.tensorboard=true", "logging.all_ranks=true")  # fmt: skip
    return ["-m", "service", "train", *(item for override in overrides for item in ("--set", override))]


def run_two_nodes(tmp_path: Path, backend: str, endpoint: str, run_id: str, warm: bool = False
                  ) -> tuple[Path, list[Agent]]:  # fmt: skip
    run_dir = tmp_path / backend
    agents = [Agent(tmp_path / f"{backend}-{addr}.log", addr, backend, endpoint, run_id, str(NNODES), NPROC,
                    job(run_dir), max_restarts=0, warm=warm) for addr in ("127.0.0.2", "127.0.0.3")]  # fmt: skip
    try:
        for agent in agents:
            code = agent.wait(timeout=150)
            assert code == 0, f"agent {agent.local_addr} exited {code}:\n{agent.log()[-4000:]}"
    finally:
        for agent in agents:
            agent.kill()
    return run_dir, agents


def assert_headline(run_dir: Path, agents: list[Agent]) -> None:
    import json

    summaries = sorted(run_dir.rglob("summary.json"))
    assert summaries == [run_dir / "summary.json"], summaries  # one summary, from rank 0
    summary = json.loads(summaries[0].read_text())
    assert (summary["status"], summary["world_size"], summary["global_step"], summary["launcher"]) == (
        "completed", NNODES * NPROC, STEPS, "torchrun")  # fmt: skip
    for rank in range(NNODES * NPROC):
        events = list((run_dir / "tensorboard" / f"rank{rank}").glob("events.out.tfevents.*"))
        assert events, f"no TensorBoard events for rank {rank}"
    ranks = [{int(r) for r in re.findall(r"\[rank (\d+)\] INFO done:", agent.log())} for agent in agents]
    assert [len(node) for node in ranks] == [NPROC, NPROC] and set().union(*ranks) == set(range(NNODES * NPROC))


def test_two_nodes_of_four_processes_through_c10d(tmp_path):
    started = time.monotonic()
    run_dir, agents = run_two_nodes(tmp_path, "c10d", f"127.0.0.2:{free_port()}", "headline-c10d")
    assert_headline(run_dir, agents)
    print(f"c10d: 2 x 4 processes to completion in {time.monotonic() - started:.1f} s")


def test_two_nodes_of_four_processes_through_etcd3(tmp_path):
    etcd = start_single(require_etcd(), tmp_path)
    try:
        started = time.monotonic()
        run_dir, agents = run_two_nodes(tmp_path, "etcd3", etcd.endpoint, "headline-etcd3", warm=True)
        assert_headline(run_dir, agents)
        print(f"etcd3: 2 x 4 processes to completion in {time.monotonic() - started:.1f} s")
    finally:
        etcd.kill()
