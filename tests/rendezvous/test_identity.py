"""One job per run id (a job fingerprint in etcd) and no split brain (a lost run stops its agent).

Units of the fingerprint, the claim and the backend's guard against a real etcd,
then real torchrun agents: a second job with the same run id is refused and the
first one carries on; an agent whose run keys are deleted or whose lease is
revoked mid-run stops its workers and exits non-zero.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from service.rendezvous.identity import (
    JOB_ENV,
    JobMismatchError,
    claim_run,
    describe_command,
    fingerprint_of,
    this_job,
)
from service.rendezvous.lease import RunLostError
from service.rendezvous.options import parse_options
from service.rendezvous.parts import Etcd3Parts

from .agents import Agent
from .conftest import REPO, EtcdMember, etcdctl

PREFIX = "/torchelastic/etcd3"
SMOKE = str(REPO / "tests" / "scripts" / "allreduce_smoke.py")

# A worker that reports its pid, then idles: a long job that costs no CPU on a shared machine.
IDLE_WORKER = """
import os, sys, time
print(f"idle worker pid={os.getpid()} rank={os.environ.get('RANK')} world={os.environ.get('WORLD_SIZE')}", flush=True)
deadline = time.monotonic() + float(sys.argv[1])
stop = sys.argv[2] if len(sys.argv) > 2 else None  # a file that ends the idling early once it exists
while time.monotonic() < deadline and not (stop and os.path.exists(stop)):
    time.sleep(0.1)
print("idle worker done", flush=True)
"""


def parts_for(endpoint: str, run_id: str) -> Etcd3Parts:
    parts = Etcd3Parts(parse_options(endpoint, run_id, {}))
    parts.connect()
    return parts


# -- the fingerprint ---------------------------------------------------------------
def test_command_is_described_by_file_content_not_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "train.py").write_text("print('hi')\n")
        (d / "job.yaml").write_text("lr: 0.1\n")
    in_a = describe_command(sys.executable, ["-u", str(a / "train.py"), "--config=job.yaml", "--lr", "0.1"], cwd=a)
    in_b = describe_command("/other/venv/bin/python3", ["-u", "train.py", "--config=job.yaml", "--lr", "0.1"], cwd=b)
    assert in_a == in_b
    assert in_a[0] == "python" and in_a[2].startswith("<file train.py sha256:")
    assert in_a[3].startswith("--config=<file job.yaml sha256:")

    (b / "job.yaml").write_text("lr: 0.2\n")  # an edited config file is another job
    edited = describe_command(sys.executable, ["-u", "train.py", "--config=job.yaml", "--lr", "0.1"], cwd=b)
    assert fingerprint_of(edited, "1", "1:2") != fingerprint_of(in_a, "1", "1:2")
    assert fingerprint_of(in_a, "1", "1:2") != fingerprint_of(in_a, "2", "1:2")
    assert fingerprint_of(in_a, "1", "1:2") != fingerprint_of(in_a, "1", "2:2")


def test_job_name_from_env_replaces_the_command() -> None:
    one = this_job(1, 2, {JOB_ENV: "nightly"})
    two = this_job(1, 2, {JOB_ENV: "nightly"})
    assert one.fingerprint == two.fingerprint and one.command == [f"{JOB_ENV}=nightly"]
    assert this_job(1, 2, {JOB_ENV: "other"}).fingerprint != one.fingerprint


@pytest.mark.e2e
def test_claim_records_once_and_refuses_another_job(etcd_server: EtcdMember, run_id: str) -> None:
    first, second = parts_for(etcd_server.endpoint, run_id), parts_for(etcd_server.endpoint, run_id)
    try:
        job_a = this_job(1, 2, {JOB_ENV: "job-a"})
        job_b = this_job(1, 2, {JOB_ENV: "job-b"})
        assert claim_run(first.client, first.lease, PREFIX, run_id, job_a) == job_a
        # The same job again (another node) is accepted and told what was recorded.
        assert claim_run(second.client, second.lease, PREFIX, run_id, this_job(1, 2, {JOB_ENV: "job-a"})) == job_a
        with pytest.raises(JobMismatchError) as refused:
            claim_run(second.client, second.lease, PREFIX, run_id, job_b)
        message = str(refused.value)
        assert job_a.fingerprint[:16] in message and job_b.fingerprint[:16] in message
        assert "job-a" in message and "job-b" in message and "--rdzv-id" in message and "retire" in message
        # The record lives on the run's lease, so it goes with the run.
        _, meta = first.client.call(lambda c: c.get(f"{PREFIX}/{run_id}/job".encode()), "read")
        assert meta.lease_id == first.lease.id()
    finally:
        first.close()
        second.close()


@pytest.mark.e2e
def test_garbage_job_record_is_refused_by_name(etcd_server: EtcdMember, run_id: str) -> None:
    parts = parts_for(etcd_server.endpoint, run_id)
    try:
        etcdctl(etcd_server.endpoint, "put", f"{PREFIX}/{run_id}/job", "not json")
        with pytest.raises(JobMismatchError, match=f"{PREFIX}/{run_id}/job.*not one this backend wrote"):
            claim_run(parts.client, parts.lease, PREFIX, run_id, this_job(1, 1, {JOB_ENV: "x"}))
    finally:
        parts.close()


# -- the split-brain guard in the backend --------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("how", ["delete-prefix", "revoke-lease", "recreated"])
def test_backend_refuses_a_run_whose_keys_vanished(etcd_server: EtcdMember, run_id: str, how: str) -> None:
    agent = parts_for(etcd_server.endpoint, run_id)
    other = None
    try:
        assert agent.backend.get_state() is None  # nothing seen yet: an absent state is just a new run
        _, token, _ = agent.backend.set_state(b"world 1")
        if how == "revoke-lease":
            etcdctl(etcd_server.endpoint, "lease", "revoke", f"{agent.lease.id():x}")
        else:
            etcdctl(etcd_server.endpoint, "del", "--prefix", f"{PREFIX}/{run_id}/")
        if how == "recreated":  # a second agent with the same id starts a new world at once
            other = parts_for(etcd_server.endpoint, run_id)
            other.backend.set_state(b"world 2")
        with pytest.raises(RunLostError) as lost:
            agent.backend.get_state()
        message = str(lost.value)
        assert run_id in message and "split brain" in message and "ddp-service rdzv retire" in message
        assert "deleted or its lease revoked" in message
        # Sticky: every later read and write (torch's heartbeat) fails the same way.
        with pytest.raises(RunLostError):
            agent.backend.set_state(b"heartbeat", token)
        with pytest.raises(RunLostError):
            agent.backend.get_state()
    finally:
        agent.close()
        if other is not None:
            other.close()


@pytest.mark.e2e
def test_heartbeat_write_notices_a_deleted_run(etcd_server: EtcdMember, run_id: str) -> None:
    agent = parts_for(etcd_server.endpoint, run_id)
    try:
        _, token, _ = agent.backend.set_state(b"world 1")
        etcdctl(etcd_server.endpoint, "del", "--prefix", f"{PREFIX}/{run_id}/")
        with pytest.raises(RunLostError, match="state key .* was deleted"):
            agent.backend.set_state(b"heartbeat", token)
    finally:
        agent.close()


# -- real torchrun agents ----------------------------------------------------------------
AgentFactory = Callable[..., Agent]


def idle_script(tmp_path: Path) -> Path:
    path = tmp_path / "idle_worker.py"
    path.write_text(IDLE_WORKER)
    return path


@pytest.mark.e2e
def test_second_job_with_the_same_run_id_is_refused_and_the_first_carries_on(
    etcd_server: EtcdMember, agents: AgentFactory, tmp_path: Path, run_id: str
) -> None:
    stop = tmp_path / "stop"
    a = agents("127.0.0.2", etcd_server.endpoint, "1:2", 1, [str(idle_script(tmp_path)), "60", str(stop)])
    a.wait_for(r"idle worker pid=\d+ rank=0 world=1", timeout=90)
    b = agents("127.0.0.3", etcd_server.endpoint, "1:2", 1, [SMOKE])
    assert b.wait(timeout=90) != 0
    refusal = b.log()
    assert "JobMismatchError" in refusal and f"run id '{run_id}' already belongs to another job" in refusal
    assert "idle_worker.py sha256:" in refusal and "allreduce_smoke.py sha256:" in refusal
    fingerprints = re.findall(r"fingerprint ([0-9a-f]{16})", refusal)
    assert len(set(fingerprints)) == 2, refusal[-3000:]
    assert "allreduce rank" not in refusal  # its worker never started
    # The first job never saw the second: no restart into a bigger world, and it ends well. It idles on for 4 s
    # after the refusal (a node's liveness is 3 s: 3 keep-alives 1 s apart), then ends.
    time.sleep(4)
    stop.touch()
    assert a.wait(timeout=90) == 0
    log = a.log()
    assert "idle worker done" in log and "world=2" not in log and "new nodes" not in log


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["delete-prefix", "revoke-lease"])
def test_agent_stops_its_workers_when_its_run_vanishes(
    etcd_server: EtcdMember, agents: AgentFactory, tmp_path: Path, run_id: str, how: str
) -> None:
    a = agents("127.0.0.2", etcd_server.endpoint, "1:2", 1, [str(idle_script(tmp_path)), "300"])
    worker = int(a.wait_for(r"idle worker pid=(\d+) rank=0 world=1", timeout=90).group(1))
    assert _alive(worker)
    if how == "revoke-lease":
        lease = etcdctl(etcd_server.endpoint, "get", "--print-value-only", f"{PREFIX}/{run_id}/lease").strip()
        etcdctl(etcd_server.endpoint, "lease", "revoke", f"{int(lease):x}")
    else:
        etcdctl(etcd_server.endpoint, "del", "--prefix", f"{PREFIX}/{run_id}/")
    gone_at = time.monotonic()
    code = a.wait(timeout=60)
    took = time.monotonic() - gone_at
    log = a.log()
    assert code != 0, log[-3000:]
    assert "RunLostError" in log and "split brain" in log and "ddp-service rdzv retire" in log
    assert "idle worker done" not in log
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"worker {worker} outlived its agent"
    # torch's monitor loop reads the state about every second; shutting the workers down takes a few more.
    assert took < 30, f"the agent took {took:.1f} s to stop"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
