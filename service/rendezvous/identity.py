"""One job per run id: the first agent records a job fingerprint, later agents must match it.

Without this, two different jobs started with the same ``--rdzv-id`` merge into
one world (job A's rank 0 next to job B's rank 1), or the second one crashes
deep inside torch. Before an agent joins the rendezvous, it computes a
fingerprint of the job it is about to run and creates ``<prefix>/<run_id>/job``
on the run's lease with a transaction that succeeds only if the key is absent.
If the key is already there with another fingerprint, the agent is refused
with :class:`JobMismatchError`, naming both fingerprints and what they were
computed from.

What is hashed (SHA-256 over a JSON document):

- the worker command torchrun will run, taken from torch's own ``launch_agent``
  call (its ``entrypoint`` and ``args``) on the stack: the Python interpreter
  is written as ``python`` (its path differs between nodes), a callable as its
  qualified name;
- for each argument that names an existing regular file (also the ``VALUE`` of
  ``--opt=VALUE``): the file's base name and the SHA-256 of its content instead
  of its path, so nodes with the same script and config file in different
  directories agree, and an edited config file is another job. Files over
  64 MiB are described by name and size only;
- ``--nproc-per-node`` (as torchrun resolved it) and ``--nnodes`` (min:max).

Not hashed: the environment, the code of a module started with ``-m`` (only
the files named on the command line), and the torchrun options that are not
listed above. When the handler is created outside torchrun, ``sys.argv`` stands
in for the worker command. Setting ``DDP_SERVICE_RDZV_JOB=NAME`` on every node
replaces all of this with the name, for jobs whose nodes run deliberately
different commands.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError

from service.rendezvous.client import EtcdClient, EtcdError, LeaseNotFoundError
from service.rendezvous.dynamic.backend import run_key
from service.rendezvous.lease import RunLease

JOB_ENV = "DDP_SERVICE_RDZV_JOB"
_LAUNCHER = "torch.distributed.launcher.api"  # its launch_agent(config, entrypoint, args) creates the handler
MAX_HASHED_FILE = 64 * 1024 * 1024
_ATTEMPTS = 3


class JobMismatchError(RendezvousError):
    """Another job already owns this run id."""


class JobRecord(BaseModel):
    """What ``<prefix>/<run_id>/job`` holds (JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    command: list[str]
    nproc_per_node: str | None = None
    nnodes: str
    host: str = ""
    pid: int = 0
    started: float = 0.0

    def describe(self) -> str:
        """The fingerprint's inputs, for error messages."""
        where = f" (agent pid {self.pid} on {self.host or '?'})" if self.pid else ""
        return (
            f"fingerprint {self.fingerprint[:16]} of command [{' '.join(self.command)}], "
            f"nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}{where}"
        )


# -- computing the fingerprint -------------------------------------------------
def worker_command() -> tuple[Any, list[Any], Any]:
    """(entrypoint, args, nproc_per_node) of the job torchrun is launching, read from its ``launch_agent`` frame."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "launch_agent" and frame.f_globals.get("__name__") == _LAUNCHER:
            found = frame.f_locals
            nproc = getattr(found.get("config"), "nproc_per_node", None)
            return found.get("entrypoint"), list(found.get("args") or []), nproc
        frame = frame.f_back
    return None, list(sys.argv), None


def describe_command(entrypoint: Any, args: Sequence[Any], cwd: Path | None = None) -> list[str]:
    """The command as hashed: interpreter as ``python``, named files as name plus content hash."""
    cwd = Path.cwd() if cwd is None else cwd
    parts: list[str] = []
    if callable(entrypoint):
        name = getattr(entrypoint, "__qualname__", repr(entrypoint))
        parts.append(f"{getattr(entrypoint, '__module__', '?')}.{name}")
    elif entrypoint is not None:
        parts.append(_describe_entrypoint(str(entrypoint), cwd))
    for arg in args:
        parts.append(_describe_arg(str(arg), cwd))
    return parts


def _describe_entrypoint(entrypoint: str, cwd: Path) -> str:
    if _is_python(entrypoint):
        return "python"
    return _describe_arg(entrypoint, cwd)


def _is_python(path: str) -> bool:
    if path == sys.executable:
        return True
    try:
        if os.path.realpath(path) == os.path.realpath(sys.executable):
            return True
    except OSError:
        pass
    return Path(path).name.startswith("python")


def _describe_arg(arg: str, cwd: Path) -> str:
    described = _describe_file(arg, cwd)
    if described is not None:
        return described
    if arg.startswith("-") and "=" in arg:
        option, value = arg.split("=", 1)
        described = _describe_file(value, cwd)
        if described is not None:
            return f"{option}={described}"
    return arg


def _describe_file(text: str, cwd: Path) -> str | None:
    if not text or "\x00" in text:
        return None
    path = Path(text) if os.path.isabs(text) else cwd / text
    try:
        if not path.is_file():
            return None
        size = path.stat().st_size
        if size > MAX_HASHED_FILE:
            return f"<file {path.name}, {size} bytes>"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return f"<file {path.name} sha256:{digest[:16]}>"


def fingerprint_of(command: list[str], nproc_per_node: str | None, nnodes: str) -> str:
    """SHA-256 (hex) over the canonical JSON of the fingerprint's inputs."""
    document = json.dumps({"command": command, "nproc_per_node": nproc_per_node, "nnodes": nnodes}, sort_keys=True)
    return hashlib.sha256(document.encode("utf-8")).hexdigest()


def this_job(min_nodes: int, max_nodes: int, environ: dict[str, str] | None = None) -> JobRecord:
    """The record of the job this agent runs."""
    environ = dict(os.environ) if environ is None else environ
    nnodes = f"{min_nodes}:{max_nodes}"
    name = environ.get(JOB_ENV, "").strip()
    if name:
        command, nproc = [f"{JOB_ENV}={name}"], None
    else:
        entrypoint, args, nproc_value = worker_command()
        command = describe_command(entrypoint, args)
        nproc = None if nproc_value is None else str(nproc_value)
    return JobRecord(
        fingerprint=fingerprint_of(command, nproc, nnodes),
        command=command,
        nproc_per_node=nproc,
        nnodes=nnodes,
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.time(),
    )


# -- claiming the run ------------------------------------------------------------
def claim_run(client: EtcdClient, lease: RunLease, key_prefix: str, run_id: str, mine: JobRecord) -> JobRecord:
    """Record ``mine`` as the run's job, or check it against the job already recorded.

    Returns the recorded job. Raises :class:`JobMismatchError` when another job
    owns the run, and ``RendezvousConnectionError`` when etcd cannot be used.
    """
    key = run_key(key_prefix, run_id, "job")
    value = mine.model_dump_json().encode("utf-8")
    for _ in range(_ATTEMPTS):
        try:
            lease_id = lease.id()
        except EtcdError as exc:
            raise RendezvousConnectionError(f"The etcd3 rendezvous cannot record the job fingerprint: {exc}") from exc
        try:
            won, responses = _create_or_get(client, key, value, lease_id)
        except LeaseNotFoundError:
            lease.invalidate(lease_id)
            continue
        except EtcdError as exc:
            raise RendezvousConnectionError(f"The etcd3 rendezvous cannot record the job fingerprint: {exc}") from exc
        if won:
            return mine
        if not responses[0]:
            continue  # deleted between compare and read: try again
        recorded = parse_record(responses[0][0][0], key)
        if recorded.fingerprint != mine.fingerprint:
            raise JobMismatchError(mismatch_message(run_id, key_prefix, recorded, mine))
        return recorded
    raise RendezvousConnectionError(
        f"The etcd3 rendezvous could not record the job fingerprint under {key.decode()} in {_ATTEMPTS} attempts; "
        "its lease or key kept disappearing. Check that nothing deletes the run's keys while agents start."
    )


def _create_or_get(client: EtcdClient, key: bytes, value: bytes, lease_id: int) -> tuple[bool, Any]:
    """One transaction: put ``value`` on the lease if ``key`` is absent, else read the key."""
    tx = client.raw.transactions
    return client.call(
        lambda c: c.transaction(
            compare=[tx.create(key) == 0], success=[tx.put(key, value, lease=lease_id)], failure=[tx.get(key)]
        ),
        "recording the job fingerprint",
    )


def parse_record(raw: bytes, key: bytes) -> JobRecord:
    """The stored job record, or ``JobMismatchError`` naming the key when it is not one."""
    try:
        return JobRecord.model_validate_json(raw)
    except ValidationError as exc:
        raise JobMismatchError(
            f"The job record under {key.decode()} in etcd is not one this backend wrote ({exc.error_count()} "
            f"problem(s), first: {exc.errors()[0]['msg']}), so this agent cannot tell whether the run belongs to "
            "its job. Use another --rdzv-id, or retire the run with 'ddp-service rdzv retire'."
        ) from None


def mismatch_message(run_id: str, key_prefix: str, recorded: JobRecord, mine: JobRecord) -> str:
    """The refusal: both fingerprints, what they were computed from, and the fix."""
    return (
        f"The rendezvous run id '{run_id}' already belongs to another job, so this agent does not join it "
        f"(two jobs would merge into one world). etcd records {recorded.describe()}. This agent's job has "
        f"{mine.describe()}. Give this job its own --rdzv-id. If the other job has finished, retire its run with "
        f"'ddp-service rdzv retire --endpoint HOST:PORT --prefix {key_prefix} {run_id}', or wait until its keys "
        f"expire (the rendezvous ttl after its last agent exits). If the nodes of one job deliberately run "
        f"different commands, set {JOB_ENV}=NAME to the same name on every node."
    )


def claim_job(parts: Any, params: Any) -> JobRecord:
    """Claim the run of ``parts`` (``factory.Etcd3Parts``) for this agent's job; close ``parts`` on refusal."""
    try:
        mine = this_job(params.min_nodes, params.max_nodes)
        return claim_run(parts.client, parts.lease, parts.options.key_prefix, parts.options.run_id, mine)
    except BaseException:
        parts.close()
        raise
