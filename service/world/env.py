"""The launcher contract: who this process is in the world, read once from a mapping.

Every launcher (torchrun, a bare ``srun``, a Kubeflow PyTorchJob pod, nothing at
all) describes the process through environment variables with its own names.
Each launcher gets one small ``detect()``; the first that recognises the mapping
turns it into one frozen :class:`WorldInfo`. Nothing here writes ``os.environ``:
the caller passes the mapping in, so tests pass plain dicts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping

from service.world.hostlist import HostlistError, count_hosts, expand_hostlist, first_host  # noqa: F401 (re-export)


class EnvError(ValueError):
    """A launcher variable is missing or wrong; the message says which and how to fix it."""


def _hosts(nodelist: str) -> tuple[str, int]:
    """(first host, host count) of ``SLURM_JOB_NODELIST``, as an :class:`EnvError` when it does not parse."""
    try:
        return first_host(nodelist), count_hosts(nodelist)
    except HostlistError as exc:
        raise EnvError(f"SLURM_JOB_NODELIST: {exc}") from None


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in the job. ``rank`` is global; ``local_rank`` is per node."""

    launcher: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str | None = None
    use_agent_store: bool = False
    # The batch system around the launcher ("slurm"), whichever launcher started the processes:
    # torchrun under srun reads as launcher "torchrun", scheduler "slurm".
    scheduler: str | None = None
    # The process that restarts this one: torchrun's agent, or slurmstepd, is its parent, unless the parent is a
    # fork server the agent runs (``ddp-service launch``), which names the agent in DDP_SERVICE_AGENT_PID.
    agent_pid: int | None = None
    # A first start under ``ddp-service launch``: the Unix time its agent started. The fork server's imports were
    # made for this start, so the start-up counts from there (a worker started as a program pays them after its
    # own start).
    started_for: float | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


# --------------------------------------------------------------------------- parsing helpers


def _int(env: Mapping[str, str], name: str, default: int | None = None, fix: str = "") -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise EnvError(f"The environment variable {name} is not set. {fix}".strip())
        return default
    try:
        value = int(raw.strip())
    except ValueError as exc:
        raise EnvError(
            f"The environment variable {name}={raw!r} is not an integer. "
            f"Set it to a whole number{', ' + fix if fix else '.'}"
        ) from exc
    if value < 0:
        raise EnvError(f"The environment variable {name}={raw!r} is negative. Set it to 0 or more.")
    return value


def _check_world(info: WorldInfo, names: Mapping[str, str]) -> WorldInfo:
    """Cross-field checks shared by every launcher; ``names`` maps fields to the launcher's variables."""
    if info.world_size < 1:
        raise EnvError(f"The environment variable {names['world_size']}={info.world_size} must be at least 1.")
    if info.rank >= info.world_size:
        raise EnvError(
            f"{names['rank']}={info.rank} is not smaller than {names['world_size']}={info.world_size}. "
            "Ranks count from 0 to the world size minus 1; check the launcher's process count."
        )
    if info.local_world_size < 1:
        raise EnvError(
            f"The environment variable {names['local_world_size']}={info.local_world_size} must be at least 1."
        )
    if info.local_rank >= info.local_world_size:
        raise EnvError(
            f"{names['local_rank']}={info.local_rank} is not smaller than "
            f"{names['local_world_size']}={info.local_world_size}. Local ranks count from 0 to "
            "the number of processes on this node minus 1."
        )
    if info.world_size > 1 and not info.master_addr:
        raise EnvError(
            f"MASTER_ADDR is not set but the world has {info.world_size} processes. Set MASTER_ADDR "
            "to the host name or address of the rank-0 node, or launch with torchrun."
        )
    if info.world_size > 1 and not info.master_port:
        raise EnvError(
            f"MASTER_PORT is not set but the world has {info.world_size} processes. Set MASTER_PORT "
            "to a free TCP port on the rank-0 node, or launch with torchrun."
        )
    return info


def _master_port(env: Mapping[str, str], default: int | None) -> int | None:
    if env.get("MASTER_PORT", "").strip() == "":
        return default
    port = _int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise EnvError(f"The environment variable MASTER_PORT={port} is not a TCP port. Use 1 to 65535.")
    return port


# --------------------------------------------------------------------------- launchers


class Launcher(ABC):
    """One launcher's variables: ``detects`` says whether they are present, ``read`` parses them."""

    name: str

    @abstractmethod
    def detects(self, env: Mapping[str, str]) -> bool: ...

    @abstractmethod
    def read(self, env: Mapping[str, str]) -> WorldInfo: ...


_TORCH_NAMES = {
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
}


class TorchrunLauncher(Launcher):
    """torchrun / torch.distributed.elastic: it always sets TORCHELASTIC_RUN_ID."""

    name = "torchrun"

    def detects(self, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env and "RANK" in env

    def read(self, env: Mapping[str, str]) -> WorldInfo:
        world_size = _int(env, "WORLD_SIZE", fix="torchrun always sets it; check the launch command.")
        info = WorldInfo(
            launcher=self.name,
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK"),
            world_size=world_size,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", default=world_size),
            node_rank=_int(env, "GROUP_RANK", default=0),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_master_port(env, None),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", default=0),
            run_id=env.get("TORCHELASTIC_RUN_ID") or None,
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
        return _check_world(info, _TORCH_NAMES)


class SlurmLauncher(Launcher):
    """A bare ``srun`` with one task per process, no torchrun inside."""

    name = "slurm"
    _names = {
        "rank": "SLURM_PROCID",
        "world_size": "SLURM_NTASKS",
        "local_rank": "SLURM_LOCALID",
        "local_world_size": "SLURM_NTASKS_PER_NODE",
    }

    def detects(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_JOB_NODELIST" in env

    def read(self, env: Mapping[str, str]) -> WorldInfo:
        world_size = _int(env, "SLURM_NTASKS")
        master_host, num_nodes = _hosts(env["SLURM_JOB_NODELIST"])
        if world_size > 1 and not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
            raise EnvError(
                f"SLURM_NTASKS={world_size} is set but SLURM_STEP_ID is not: this is the batch script of Slurm "
                f"job {env.get('SLURM_JOB_ID', '?')}, not a task of an srun step, so only this one process of "
                f"the {world_size} would run and rank 0 would wait out dist.timeout_seconds for the others. "
                "Launch the workers with srun (srun python -m service train ...), or run torchrun under srun."
            )
        job_id = _int(env, "SLURM_JOB_ID", default=0)
        info = WorldInfo(
            launcher=self.name,
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID", default=0),
            world_size=world_size,
            local_world_size=_tasks_on_this_node(env, world_size, num_nodes),
            node_rank=_int(env, "SLURM_NODEID", default=0),
            master_addr=env.get("MASTER_ADDR") or master_host,
            # A port derived from the job id lets two jobs share a node without a clash; below Linux's ephemeral
            # range (32768 up), so no outgoing connection takes it before rank 0 listens (rendezvous/ports.py).
            master_port=_master_port(env, 15000 + job_id % 17000),
            restart_count=_int(env, "SLURM_RESTART_COUNT", default=0),
            run_id=env.get("SLURM_JOB_ID") or None,
        )
        return _check_world(info, self._names)


def _tasks_on_this_node(env: Mapping[str, str], world_size: int, num_nodes: int) -> int:
    """``SLURM_TASKS_PER_NODE`` reads like ``2(x3),1``; the local count is this node's entry."""
    raw = env.get("SLURM_NTASKS_PER_NODE") or ""
    if raw.strip():
        return _int(env, "SLURM_NTASKS_PER_NODE")
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    node = _int(env, "SLURM_NODEID", default=0)
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise EnvError(f"SLURM_TASKS_PER_NODE={spec!r} is not of the form '2(x3),1'.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if node < len(counts):
        return counts[node]
    return max(1, world_size // max(1, num_nodes))


class PyTorchJobLauncher(Launcher):
    """A Kubeflow PyTorchJob pod that runs the script directly, without torchrun.

    The operator sets ``RANK`` to the pod index, ``WORLD_SIZE`` to
    replicas × nprocPerNode and ``PET_NPROC_PER_NODE``/``PET_NNODES`` for
    torchrun. Without torchrun that is only right when nprocPerNode is 1;
    otherwise the ranks of the pod's processes would not exist.
    """

    name = "pytorchjob"

    def detects(self, env: Mapping[str, str]) -> bool:
        return "RANK" in env and ("PET_NPROC_PER_NODE" in env or "PET_NNODES" in env)

    def read(self, env: Mapping[str, str]) -> WorldInfo:
        per_node = env.get("PET_NPROC_PER_NODE", "1").strip()
        world_size = _int(env, "WORLD_SIZE")
        nnodes = env.get("PET_NNODES", "").strip()
        pods = int(nnodes) if nnodes.isdigit() else world_size  # "1:4" is elastic: no fixed count
        if per_node != "1" or world_size != pods:
            raise EnvError(
                f"PET_NPROC_PER_NODE={per_node!r} and WORLD_SIZE={world_size} with PET_NNODES={pods}: this "
                "PyTorchJob asks for several processes per pod, but the pod runs without torchrun, so "
                "RANK is the pod index, not a process rank. Make the container command "
                "'torchrun -m service train ...'; torchrun reads the PET_* variables the operator sets."
            )
        rank = _int(env, "RANK")
        info = WorldInfo(
            launcher=self.name,
            rank=rank,
            world_size=world_size,
            node_rank=rank,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_master_port(env, None),
        )
        return _check_world(info, _TORCH_NAMES)


class EnvLauncher(Launcher):
    """``RANK``/``WORLD_SIZE`` set by hand or by another tool (torch's ``env://`` convention)."""

    name = "env"

    def detects(self, env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    def read(self, env: Mapping[str, str]) -> WorldInfo:
        world_size = _int(env, "WORLD_SIZE")
        info = WorldInfo(
            launcher=self.name,
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK", default=0),
            world_size=world_size,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", default=1 if "LOCAL_RANK" not in env else world_size),
            node_rank=_int(env, "GROUP_RANK", default=0),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_master_port(env, None),
        )
        return _check_world(info, _TORCH_NAMES)


class NoLauncher(Launcher):
    """Plain ``python -m service``: a world of one."""

    name = "none"

    def detects(self, env: Mapping[str, str]) -> bool:
        return True

    def read(self, env: Mapping[str, str]) -> WorldInfo:
        for present, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
            if env.get(present, "").strip():
                raise EnvError(
                    f"The environment variable {present}={env[present]!r} is set but {missing} is not, so this "
                    f"process cannot know its world. Set {missing} too (torch's env:// convention needs RANK, "
                    f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT), unset {present} to run as a world of 1, or "
                    "launch with torchrun."
                )
        return WorldInfo(launcher=self.name, master_addr="127.0.0.1")


# Order matters: torchrun inside srun or inside a PyTorchJob pod wins over the outer launcher.
LAUNCHERS: tuple[Launcher, ...] = (
    TorchrunLauncher(),
    SlurmLauncher(),
    PyTorchJobLauncher(),
    EnvLauncher(),
    NoLauncher(),
)


AGENT_PID = "DDP_SERVICE_AGENT_PID"
STARTED_FOR = "DDP_SERVICE_STARTED_FOR"  # set by service/worker.py in a launch's first workers: the agent's start


def detect_world(env: Mapping[str, str]) -> WorldInfo:
    """Read the first launcher whose variables are present (NoLauncher takes any mapping)."""
    launcher = next(item for item in LAUNCHERS if item.detects(env))
    agent = _int(env, AGENT_PID, default=0) or None
    return dataclasses.replace(launcher.read(env), scheduler=detect_scheduler(env), agent_pid=agent,
                               started_for=_unix_time(env, STARTED_FOR))  # fmt: skip


def _unix_time(env: Mapping[str, str], name: str) -> float | None:
    """A Unix time the service itself put in the environment; anything else there is ignored (it only moves the
    start-up's first second in the goodput ledger)."""
    try:
        value = float(env.get(name, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def detect_scheduler(env: Mapping[str, str]) -> str | None:
    """The batch system the processes run in: Slurm sets ``SLURM_JOB_ID`` in every task of a job."""
    return "slurm" if env.get("SLURM_JOB_ID", "").strip() else None
