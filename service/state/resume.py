"""Resume on every start: the ranks agree on the newest valid checkpoint, load it, and check the config.

Every rank scans ``run_dir/checkpoints`` (see :mod:`service.state.checkpoint_io`);
one all-reduce settles the newest valid step that any rank can see, a second
finds a rank that holds it. When every rank holds it, each reads its own
copy; otherwise that rank sends the bytes over the control group, so a node
whose ``run_dir`` is not shared never silently starts from an older step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.config import JobConfig
from service.state.checkpoint_io import Manifest, load_state, scan, state_name
from service.world.distributed import bytes_to_tensor, tensor_to_bytes

log = logging.getLogger(__name__)

# Keys that may differ between a checkpoint's config and the resuming one (docs/config.md, "Resuming").
MUTABLE = (
    "run_dir", "metrics", "checkpoint", "dist", "train.log_every", "train.progress_bar",
    "data.num_workers", "data.pin_memory", "data.trace", "data.stream_resume", "ddp.bucket_cap_mb",
    "ddp.find_unused_parameters",
    "train.nonfinite", "init_from", "logging", "train.compile",
)  # fmt: skip


class ResumeError(RuntimeError):
    """The run cannot resume as asked; the message names what differs and the fix.

    Bad input, found on every rank before any step: the worker logs the message
    alone and exits 2 (``exit_code``), as for an invalid config.
    """

    exit_code = 2


SOURCES = ("disk", "snapshot")  # where a rank found the state it resumes from; a code in the agreement


@dataclasses.dataclass(frozen=True)
class Resumed:
    step: int
    file: Path
    state: dict[str, Any]
    source: str  # "disk" or "snapshot": the kind of state the agreed step was found in
    seconds: float
    peer: int | None = None  # the rank that sent it, when this rank's node did not hold it

    @property
    def disk_step(self) -> int | None:
        """The step when it came from a disk checkpoint (then in run_dir, or on the sending rank's)."""
        return self.step if self.source == "disk" else None

    def describe(self) -> dict[str, Any]:
        """``summary.json``'s ``resumed_from``: ``source`` is disk, snapshot (this node's shared memory),
        snapshot_from_peer or disk_from_peer (sent by rank ``peer``)."""
        source = self.source if self.peer is None else f"{self.source}_from_peer"
        return {"step": self.step, "file": str(self.file), "source": source, "peer": self.peer,
                "seconds": round(self.seconds, 3)}  # fmt: skip


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and key != "task_options":
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _mutable(path: str, config: Mapping[str, Any]) -> bool:
    if path in ("train.batch_size", "train.grad_accum") and config.get("train.global_batch_size") is not None:
        return True  # with a fixed global batch, the split into ranks and micro-steps may follow the world
    return any(path == key or path.startswith(f"{key}.") for key in MUTABLE)


def training_fields(config: JobConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The config keys that decide the result of training (everything but :data:`MUTABLE`)."""
    data = config.model_dump(mode="json") if isinstance(config, JobConfig) else config
    flat = _flatten(data)
    return {path: value for path, value in flat.items() if not _mutable(path, flat) and path != "train.max_steps"}


def config_hash(config: JobConfig | Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(training_fields(config), sort_keys=True).encode()).hexdigest()


def incompatible_fields(saved: Mapping[str, Any], current: JobConfig) -> list[str]:
    """Dotted keys whose change would make the resumed run differ from an uninterrupted one."""
    old, new = training_fields(saved), training_fields(current)
    changed = [f"{key} ({old.get(key)!r} -> {new.get(key)!r})" for key in sorted(old.keys() | new.keys())
               if old.get(key) != new.get(key)]  # fmt: skip
    old_max, new_max = saved.get("train", {}).get("max_steps"), current.train.max_steps
    if new_max is not None and (old_max is None or new_max < old_max):
        changed.append(f"train.max_steps ({old_max!r} -> {new_max!r}; it may only go up)")
    return changed


def check_compatible(resumed: Resumed, config: JobConfig) -> None:
    changed = incompatible_fields(resumed.state["config"], config)
    if changed:
        raise ResumeError(
            f"run_dir holds checkpoint {resumed.file} (step {resumed.step}) of a run whose config differs in "
            f"training-relevant fields: {', '.join(changed)}. Resume with the same values, start afresh with "
            "--set checkpoint.resume=never (earlier checkpoints are moved aside), or use another run_dir."
        )


def _newest_local(directory: Path, snapshots: Path | None, lineage: str | None) -> tuple[str, Manifest, bytes] | None:
    """This rank's newest valid state: its node's snapshot, or a newer disk checkpoint (an equal one: the snapshot,
    read from memory)."""
    lineages = None if lineage is None else {lineage}
    snapshot = next(scan(snapshots, lineages), None) if snapshots is not None else None
    disk = next(scan(directory, lineages, above=snapshot[0].step if snapshot else -1), None)
    if disk is not None:
        return ("disk", *disk)
    return ("snapshot", *snapshot) if snapshot is not None else None


def job_lineage(run_id: str | None) -> str | None:
    """The lineage a ``checkpoint.resume=never`` job starts: one name per job, so its restarts know their own.

    Every start of the job (a torchrun restart, a new rendezvous round) has the
    same launcher run id (``TORCHELASTIC_RUN_ID``; bare srun: the Slurm job
    id), so it finds the checkpoints the job wrote under this name. None
    without a run id: every start is then a first one.
    """
    if not run_id:
        return None
    return hashlib.sha256(f"ddp-service job {run_id}".encode()).hexdigest()[:32]


def agree_on_checkpoint(directory: Path, rank: int, world_size: int, group: Any, mode: str,
                        lineage: str | None = None, snapshots: Path | None = None) -> Resumed | None:  # fmt: skip
    """The state every rank resumes from, or None to start at step 0. A collective.

    Each rank offers its newest valid state: a disk checkpoint in ``directory``
    or its node's in-memory snapshot (``snapshots``, see
    :mod:`service.state.snapshot`); the newest step any rank offers wins.
    ``never`` resumes only from states of ``lineage`` (this job's own, see
    :func:`job_lineage`): the first start of the job finds none and starts
    afresh; its restarts and new rounds find what it wrote.
    """
    if mode == "never" and lineage is None:
        return None
    started = time.perf_counter()
    local = _newest_local(directory, snapshots, lineage if mode == "never" else None)
    steps = torch.tensor([local[1].step if local else -1], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    newest = int(steps.item())
    if newest < 0:
        if mode == "require":
            raise ResumeError(
                f"checkpoint.resume=require, but no rank found a valid checkpoint in {directory}. Point run_dir "
                "at the run to resume, or use checkpoint.resume=auto to start afresh when there is none."
            )
        log.info("no checkpoint in %s: starting at step 0", directory)
        return None
    holds = local is not None and local[1].step == newest
    first_holder = torch.tensor([rank if holds else world_size], dtype=torch.int64)
    lacking = torch.tensor([0 if holds else 1], dtype=torch.int64)
    dist.all_reduce(first_holder, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(lacking, op=dist.ReduceOp.SUM, group=group)
    source, missing = int(first_holder.item()), int(lacking.item())
    kind, payload = (local[0], local[2]) if local is not None and holds else ("disk", b"")
    if missing:
        kind, payload = _broadcast_bytes(payload, source, group, kind)
    file = (snapshots if kind == "snapshot" and holds and snapshots is not None else directory) / state_name(newest)
    peer = None if holds else source
    if not holds and kind == "disk":
        log.warning("run_dir on this node does not hold %s; received it from rank %d over the process group. "
                    "Multi-node resume wants run_dir on storage every node sees (NFS, Lustre, a ReadWriteMany "
                    "PVC).", file.name, source)  # fmt: skip
    state = load_state(payload, str(file))
    resumed = Resumed(newest, file, state, kind, time.perf_counter() - started, peer)
    log.info("resuming from %s (step %d, %.1f MiB from %s%s in %.2f s)", resumed.file, newest,
             len(payload) / 2**20, "this node's " if holds else f"rank {source}'s ", kind,
             resumed.seconds)  # fmt: skip
    return resumed


def _broadcast_bytes(payload: bytes, source: int, group: Any, kind: str) -> tuple[str, bytes]:
    """The source rank's kind of state and its bytes, on every rank: the size and kind first, then the bytes."""
    header = torch.tensor([len(payload), SOURCES.index(kind)], dtype=torch.int64)
    dist.broadcast(header, src=source, group=group)
    length = int(header[0].item())
    buffer = bytes_to_tensor(payload, length)
    dist.broadcast(buffer, src=source, group=group)
    return SOURCES[int(header[1].item())], payload if payload else tensor_to_bytes(buffer, length)


def fresh_lineage(group: Any) -> str:
    """A new run's lineage, made by rank 0 and the same on every rank (each node's snapshots carry it). A collective."""
    made = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
    dist.broadcast(made, src=0, group=group)
    return bytes(made.tolist()).hex()


def rng_state() -> dict[str, Any]:
    """The generators' states at a save (each step reseeds from (seed, step, rank); these cover the rest)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
