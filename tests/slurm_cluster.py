"""A real two-node Slurm cluster on this machine, for tests/test_slurm.py.

Debian's ``slurm-wlm`` and ``munge``, started as root with everything private
to one temporary directory: a munge key and socket, a ``slurm.conf`` naming
``n[1-2]`` (both on this host, at 127.0.0.1, each slurmd on its own port),
``slurmctld -c`` (no saved state), ``slurmd -N n1`` and ``slurmd -N n2``.
Nothing under /etc is read or written: clients find the cluster through
``SLURM_CONF``, and the munge socket is named in ``AuthInfo``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import IN_CI, require_tool
from procs import kill_tree
from rendezvous.conftest import free_ports

WHY = "`make test` installs the Debian packages slurm-wlm and munge (apt-get, as root)."
CPUS_PER_NODE = 2  # two tasks per node: the bare-srun test runs 2 x 2 processes
# A requeued job waits out the job credential's lifetime (Slurm's default: 120 s), then the scheduler's next
# pass (default: every 60 s); short here, so a requeue test waits seconds.
CRED_EXPIRE = 5  # Slurm refuses less than 5 (and falls back to 120 s, which the requeue test would see)
SCHED_INTERVAL = 1
NODES = ("n1", "n2")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}  # fmt: skip


def slurm_conf(root: Path, host: str, ctld_port: int, node_port: int) -> str:
    nodes = f"n[1-{len(NODES)}]"
    return f"""\
ClusterName=ddptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval={SCHED_INTERVAL}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_port}-{node_port + len(NODES) - 1} \
CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs()}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a mapping (JobState, Restarts, ExitCode, ...)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job has ended (requeues included) and return its last record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") in FINISHED:
                return record
            time.sleep(0.5)
        record = self.job(job_id)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"Slurm job {job_id} did not end within {timeout} s: {record}\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def start(self, *cmd: str, name: str) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 (the daemon keeps it)
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))  # fmt: skip
        log.close()

    def drain(self, timeout: float = 30) -> None:
        """Cancel every job and wait until slurmd has ended their processes (slurmstepd outlives slurmd)."""
        if not self.procs or self.run("squeue", "-h", check=False).returncode != 0:
            return
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.3)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def require_slurm() -> None:
    """Root, and the Slurm and munge programs; a skip that says why, or a failure under CI=true."""
    if os.geteuid() != 0:
        message = "the test Slurm cluster runs slurmd, which needs root (it starts jobs as their users)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue"):
        require_tool(tool, WHY)


@pytest.fixture(scope="module", name="slurm")
def slurm_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require_slurm()
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "plugstack.conf").write_text("")
    host = socket.gethostname().split(".")[0]
    base = free_ports(1 + len(NODES))
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, base, base + 1))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(root, env)
    try:
        munge = root / "munge"
        cluster.start("munged", "-F", "--force", f"--key-file={key}", f"--socket={munge}/munge.socket",
                      f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed",
                      f"--log-file={root}/munged.log", name="munged")  # fmt: skip
        _wait_for(lambda: (munge / "munge.socket").exists(), 10, "munged's socket", cluster)
        cluster.start("slurmctld", "-D", "-c", "-f", str(conf), name="slurmctld")
        _wait_for(lambda: cluster.run("scontrol", "ping", check=False).returncode == 0, 30, "slurmctld", cluster)
        for node in NODES:
            cluster.start("slurmd", "-D", "-N", node, "-f", str(conf), name=f"slurmd-{node}")
        _wait_for(lambda: _idle(cluster) == set(NODES), 60, "both nodes idle", cluster)
        yield cluster
    finally:
        cluster.drain()
        cluster.stop()


def _idle(cluster: SlurmCluster) -> set[str]:
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if len(line.split()) == 2 and line.split()[1] == "idle"}


def _wait_for(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    outs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in cluster.root.glob("*.out"))
    raise AssertionError(
        f"the test Slurm cluster did not come up: no {what} within {timeout} s\n{cluster.logs()}\n{outs}"
    )
