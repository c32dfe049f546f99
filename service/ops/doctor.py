"""``ddp-service doctor``: a preflight of this machine and launcher, before a job (or when one will not start).

``ddp-service doctor [job.yaml] [--set ...] [launch's and torchrun's options] [--json]`` takes the same
line as ``ddp-service launch`` and checks, without starting a worker:

- the launcher's environment contract (as ``ddp-service env``) and the job config;
- the backend and device: torch, CUDA and NCCL versions, the GPU count against ``--nproc-per-node``;
- the rendezvous: ``MASTER_ADDR:MASTER_PORT`` or the ``--rdzv-endpoint``; for etcd3 every endpoint, the
  cluster's health and version and this machine's clock skew against etcd (service/ops/doctor_checks.py);
- that ``run_dir`` is writable with room for ``checkpoint.keep`` checkpoints of this model;
- that the metrics ports (``metrics.port`` + local rank) are free, and (a warning) outside the kernel's ephemeral
  range, from which an outgoing connection may take one before its worker listens;
- ``/dev/shm`` against the DataLoader workers and the in-memory snapshots;
- stale in-memory snapshot areas (their agent process is gone): listed with their size and the command that
  removes them (doctor removes nothing).

It prints a table (with a fix under every failed check) or ``--json``, and exits 1 when a check fails,
2 when its own command line is wrong, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from service.config import ConfigError, JobConfig, load_config
from service.ops.doctor_checks import (
    Check,
    batch_bytes,
    check_etcd,
    check_metrics_ports,
    check_run_dir,
    check_shm,
    check_snapshot_areas,
    check_store_address,
    checkpoint_bytes,
    fail,
    ok,
)
from service.ops.launcher import LaunchError, LaunchRequest, parse_request
from service.world.env import EnvError, WorldInfo, detect_world


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    parser = argparse.ArgumentParser(prog="ddp-service doctor", add_help=False)
    parser.add_argument("--json", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return 0
    try:
        request = parse_request(rest, environ)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    checks = run_checks(request, environ)
    print(json.dumps(as_json(checks), indent=2) if args.json else as_table(checks))
    return 1 if any(check.status == "fail" for check in checks) else 0


def run_checks(request: LaunchRequest, environ: Mapping[str, str]) -> list[Check]:
    checks: list[Check] = []
    try:
        world: WorldInfo | None = detect_world(environ)
        checks.append(ok("env contract", _describe_world(world)))  # type: ignore[arg-type]
    except EnvError as exc:
        world = None
        checks.append(fail("env contract", str(exc), "Set the variable as the message says; `ddp-service env` "
                           "prints what this process sees."))  # fmt: skip
    nproc = int(request.torchrun.nproc_per_node)
    if world is not None and world.launcher != "none":
        nproc = world.local_world_size
    try:
        config: JobConfig | None = load_config(request.config_path, request.overrides)
        checks.append(ok("config", f"task {config.task}, run_dir {config.run_dir}"))  # type: ignore[union-attr]
    except ConfigError as exc:
        config = None
        checks.append(fail("config", str(exc), "`ddp-service validate` shows the resolved config; fix each key."))
    checks += check_device(config, nproc, explicit=request.torchrun.nproc_per_node)
    checks += check_rendezvous(request, world)
    if config is None:
        return checks
    task, task_check = _build_task(config)
    checks.append(task_check)
    checkpoint = _measure(lambda: checkpoint_bytes(task, config), task)
    checks.append(check_run_dir(config, checkpoint))
    checks.append(check_metrics_ports(config, nproc))
    checks.append(check_shm(config, nproc, _measure(lambda: batch_bytes(task, config.train.batch_size), task),
                            snapshot=checkpoint))  # fmt: skip
    checks.append(check_snapshot_areas(config))
    return checks


def _describe_world(world: WorldInfo) -> str:
    if world.launcher == "none":
        return "no launcher variables: a world of 1 (launch or torchrun set them for the workers)"
    return (f"{world.launcher}: rank {world.rank} of {world.world_size}, local rank {world.local_rank} of "
            f"{world.local_world_size}, node {world.node_rank}, "
            f"master {world.master_addr}:{world.master_port}")  # fmt: skip


def _build_task(config: JobConfig) -> tuple[Any, Check]:
    """The task's model and data, on the CPU and without a process group, as each worker builds them."""
    import torch

    from service.tasks.loader import TaskError, load_task

    torch.manual_seed(config.seed)
    try:
        task = load_task(config.task, config.seed, config.task_options)
    except TaskError as exc:
        return None, fail("task", str(exc), "Fix the task reference or its task_options.")
    parameters = sum(p.numel() for p in task.model.parameters())
    return task, ok("task", f"{config.task}: {parameters:,} parameters, {len(task.train_set)} training samples")  # type: ignore[arg-type]


def _measure(measure: Any, task: Any) -> int | None:
    if task is None:
        return None
    try:
        return int(measure())
    except Exception:  # a task whose samples are not tensors: the size stays unknown, the check says so
        return None


def check_device(config: JobConfig | None, nproc: int, explicit: str) -> list[Check]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    backend = config.dist.backend if config else "auto"
    resolved = ("nccl" if cuda else "gloo") if backend == "auto" else backend
    checks = []
    if cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {gpus} GPU(s)"
    else:
        versions = f"torch {torch.__version__}, no CUDA device: CPU processes"
    available = {"nccl": dist.is_nccl_available() and cuda, "gloo": dist.is_gloo_available()}
    if not available[resolved]:
        checks.append(fail("backend", f"{versions}; dist.backend={backend} resolves to {resolved}, not usable here",
                           "Set dist.backend=auto (NCCL with GPUs, gloo without) or gloo."))  # fmt: skip
    else:
        checks.append(ok("backend", f"{versions}; dist.backend={backend}: {resolved}"))
    if cuda and nproc > gpus:
        checks.append(fail("GPUs", f"{nproc} processes per node but {gpus} GPU(s) visible",
                           f"Use --nproc-per-node={gpus} (or auto), or make more GPUs visible "
                           "(CUDA_VISIBLE_DEVICES, the scheduler's GPU request)."))  # fmt: skip
    elif cuda and nproc < gpus:
        checks.append(Check("GPUs", "warn", f"{nproc} processes per node leave {gpus - nproc} of {gpus} GPU(s) idle"))
    else:
        checks.append(ok("GPUs", f"{nproc} process(es) per node" + (f" on {gpus} GPU(s)" if cuda else " on CPU")))
    return checks


def check_rendezvous(request: LaunchRequest, world: WorldInfo | None) -> list[Check]:
    """Under a launcher: its MASTER_ADDR:MASTER_PORT. Else what launch would use: the endpoint of the backend."""
    options = request.torchrun
    if world is not None and world.is_distributed and world.master_addr and world.master_port:
        # Under torchrun the agent's store already listens; elsewhere rank 0 hosts it (torch's env://).
        hosts = world.rank == 0 and world.launcher != "torchrun"
        return [check_store_address("master", world.master_addr, world.master_port, hosts, "rank 0's TCP store")]
    if options.standalone:
        return [ok("rendezvous", "standalone: a c10d store on a free local port, nothing to reach")]
    backend = options.rdzv_backend
    if backend == "etcd3":
        return _etcd3(request)
    if backend == "static":
        port = options.master_port or 29500
        hosts = options.node_rank == 0
        return [check_store_address("master", options.master_addr, port, hosts, "the node-rank-0 agent's store")]
    if backend == "c10d":
        host, _, port = options.rdzv_endpoint.rpartition(":")
        if not host:
            host, port = options.rdzv_endpoint, "29400"
        if not port.isdigit():
            return [fail("rendezvous", f"--rdzv-endpoint={options.rdzv_endpoint!r} has no port number",
                         "Write it as HOST:PORT, e.g. node0:29400.")]  # fmt: skip
        return [check_store_address("rendezvous", host.strip("[]"), int(port), True, "the c10d rendezvous store")]
    return [Check("rendezvous", "skip", f"--rdzv-backend={backend}: doctor checks c10d, etcd3 and static")]


def _etcd3(request: LaunchRequest) -> list[Check]:
    from service.rendezvous.options import parse_options

    options = request.torchrun
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in options.rdzv_conf.split(","))):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    try:
        parsed = parse_options(options.rdzv_endpoint, options.rdzv_id if options.rdzv_id != "none" else "doctor", conf)
    except ValueError as exc:
        return [fail("rendezvous", str(exc), "Fix --rdzv-endpoint or --rdzv-conf (docs/rendezvous.md lists them).")]
    return check_etcd(parsed)


# --------------------------------------------------------------------------- output


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {
        "ok": not any(check.status == "fail" for check in checks),
        "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "fix": c.fix or None} for c in checks],
    }


def as_table(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = [f"{'STATUS':6}  {'CHECK':{width}}  DETAIL"]
    for check in checks:
        detail = check.detail.replace("\n", "\n" + " " * (width + 10))
        lines.append(f"{check.status.upper():6}  {check.name:{width}}  {detail}")
        if check.fix:
            lines.append(f"{'':6}  {'':{width}}  fix: {check.fix}")
    failed = sum(check.status == "fail" for check in checks)
    lines.append(f"{failed} check(s) failed." if failed else "All checks passed.")
    return "\n".join(lines)
