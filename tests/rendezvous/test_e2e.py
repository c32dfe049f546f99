"""End-to-end: real torchrun agents on 127.0.0.2/3/4 rendezvous through a real etcd.

Tiny jobs, bounded waits; every agent is killed (with its workers) on teardown.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from procs import worker_pids

from .agents import Agent, recovery_seconds, train_args
from .conftest import REPO, EtcdCluster, EtcdMember, free_port

pytestmark = pytest.mark.e2e

SMOKE = [str(REPO / "tests" / "scripts" / "allreduce_smoke.py")]
AgentFactory = Callable[..., Agent]


@pytest.fixture
def agents(tmp_path: Path, run_id: str) -> Iterator[AgentFactory]:
    started: list[Agent] = []

    def start(addr: str, endpoint: str, nnodes: str, nproc: int, script: list[str], **kw) -> Agent:
        agent = Agent(tmp_path / f"agent-{addr}-{len(started)}.log", addr, "etcd3", endpoint, run_id, nnodes, nproc, script, **kw)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_ok(agent: Agent, timeout: float) -> None:
    rc = agent.wait(timeout)
    assert rc == 0, f"agent {agent.local_addr} exited {rc}:\n{agent.log()[-4000:]}"


def test_f_plain_script_runs_on_etcd3(etcd_server: EtcdMember, agents: AgentFactory) -> None:
    a = agents("127.0.0.2", etcd_server.endpoint, "2", 1, SMOKE)
    b = agents("127.0.0.3", etcd_server.endpoint, "2", 1, SMOKE)
    for agent in (a, b):
        assert_ok(agent, 90)
    logs = a.log() + b.log()
    assert logs.count("world=2 sum=3 expected=3 ok=True") == 2, logs[-3000:]


def test_a_two_agents_two_procs_make_a_world_of_four(etcd_server: EtcdMember, agents: AgentFactory, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = train_args(run_dir, 3)
    a = agents("127.0.0.2", etcd_server.endpoint, "2", 2, job)
    b = agents("127.0.0.3", etcd_server.endpoint, "2", 2, job)
    for agent in (a, b):
        assert_ok(agent, 120)
    result = summary(run_dir)
    assert (result["world_size"], result["global_step"], result["restarts"]) == (4, 3, 0)


def kill_rank0_node(a: Agent, b: Agent) -> tuple[Agent, Agent, float]:
    """SIGKILL the node whose worker is global rank 0 (it hosts the workers' TCPStore)."""
    victim, survivor = (a, b) if "[rank 0]" in a.log() else (b, a)
    killed_at = time.time()
    victim.kill()
    return victim, survivor, killed_at


def test_b_survivor_of_a_lost_node_finishes_as_a_world_of_two(
    etcd_server: EtcdMember, agents: AgentFactory, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job = train_args(run_dir, 30)
    a = agents("127.0.0.2", etcd_server.endpoint, "1:2", 2, job)
    b = agents("127.0.0.3", etcd_server.endpoint, "1:2", 2, job)
    a.wait_for(r"\[rank [0-3]\].*\bstep 2\b", 120)
    b.wait_for(r"\[rank [0-3]\].*\bstep 2\b", 30)
    _, survivor, killed_at = kill_rank0_node(a, b)
    assert_ok(survivor, 120)
    result = summary(run_dir)
    assert result["world_size"] == 2 and result["global_step"] == 30 and result["restarts"] >= 1
    recovery = recovery_seconds(survivor, killed_at)
    assert recovery is not None
    print(f"recovery after losing the rank-0 node: {recovery:.2f} s")
    assert recovery < 12  # about 5 s on an idle machine; bench/rendezvous.py measures it


def test_b2_a_killed_worker_restarts_both_nodes_into_one_world(
    etcd_server: EtcdMember, agents: AgentFactory, tmp_path: Path
) -> None:
    """The node that lost a worker restarts as attempt 1, its peer (a membership change) as attempt 0.

    Their workers must still meet: the store they share is fresh each round, so
    nothing in it may be keyed on the per-agent restart count.
    """
    run_dir = tmp_path / "run"
    job = train_args(run_dir, 40)
    a = agents("127.0.0.2", etcd_server.endpoint, "1:2", 1, job)
    b = agents("127.0.0.3", etcd_server.endpoint, "1:2", 1, job)
    a.wait_for(r"\[rank [01]\].*\bstep 2\b", 120)
    b.wait_for(r"\[rank [01]\].*\bstep 2\b", 30)
    os.kill(worker_pids(b.proc.pid)[0], signal.SIGKILL)
    for agent in (a, b):
        assert_ok(agent, 120)
    result = summary(run_dir)
    assert result["world_size"] == 2 and result["global_step"] == 40
    assert "attempt 1" in b.log() and "attempt 0" in a.log()


def test_c_a_later_agent_joins_at_the_next_round(etcd_server: EtcdMember, agents: AgentFactory, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = train_args(run_dir, 80)
    gate = tmp_path / "go"
    c = agents("127.0.0.4", etcd_server.endpoint, "2:3", 1, job, gate=gate)
    c.wait_for("gated agent ready", 60)  # torch imported; torchrun starts when the gate opens
    a = agents("127.0.0.2", etcd_server.endpoint, "2:3", 1, job)
    b = agents("127.0.0.3", etcd_server.endpoint, "2:3", 1, job)
    a.wait_for(r"\[rank [01]\].*\bstep 1\b", 120)
    gate.touch()  # the third node arrives while the world of 2 trains
    for agent in (a, b, c):
        assert_ok(agent, 180)
    result = summary(run_dir)
    assert result["world_size"] == 3 and result["global_step"] == 80
    assert "[rank 2]" in c.log() + a.log() + b.log()


def test_d_losing_an_etcd_member_mid_run_is_survived(
    etcd_cluster: EtcdCluster, agents: AgentFactory, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job = train_args(run_dir, 60)
    # The clients use the first listed member, which the test then kills.
    endpoints = etcd_cluster.endpoints
    a = agents("127.0.0.2", endpoints, "1:2", 1, job)
    b = agents("127.0.0.3", endpoints, "1:2", 1, job)
    a.wait_for(r"\[rank [01]\].*\bstep 2\b", 120)
    etcd_cluster.members[0].kill()
    time.sleep(2)  # the agents poll etcd ~10 times a second meanwhile
    assert a.proc.poll() is None and b.proc.poll() is None, a.log()[-3000:] + b.log()[-3000:]
    # A membership change now needs a rendezvous on the 2 remaining members.
    _, survivor, _ = kill_rank0_node(a, b)
    assert_ok(survivor, 120)
    result = summary(run_dir)
    assert result["world_size"] == 1 and result["restarts"] >= 1


def test_e_etcd_down_at_start_fails_fast_naming_the_endpoint(agents: AgentFactory) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    a = agents("127.0.0.2", endpoint, "1", 1, SMOKE)
    rc = a.wait(60)
    elapsed = time.monotonic() - started
    assert rc != 0
    assert "RendezvousConnectionError" in a.log() and endpoint in a.log(), a.log()[-3000:]
    assert elapsed < 20, elapsed  # read_timeout (5 s) plus interpreter start-up
