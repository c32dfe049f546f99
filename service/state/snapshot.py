"""In-memory snapshots: the resume state of every N-th optimizer step, kept in node-local shared memory.

Which steps: :mod:`service.state.snapshot_interval` (``checkpoint.snapshot_every``: a number, or ``auto``, which
measures what a snapshot costs here, as :meth:`SnapshotWriter.measured` reports it, and agrees on an interval).

Under DDP every rank holds the whole model and optimizer state, so one process
per node (its local rank 0) can keep what a restart needs in host memory that
outlives the worker process: a directory on a tmpfs (``/dev/shm`` by default,
``checkpoint.snapshot_dir``). A worker that crashes, hangs or is stopped by its
agent leaves it behind; the restarted workers of that node find it, and the
resume agreement (:func:`service.state.resume.agree_on_checkpoint`) counts it
beside the disk checkpoints. A node that lacks the agreed state receives it
from a rank that has it, as for a disk checkpoint.

A snapshot is written like a checkpoint (:mod:`service.state.checkpoint_io`):
the state under a temporary name, then its manifest (step, size, checksum, config
hash, lineage), both renamed into place, the manifest last. Its checksum is
xxh3_128 rather than a disk checkpoint's sha256 (six times faster), and its zip
archive has no per-record crc32 (the checksum covers every byte). A snapshot counts
only when its manifest and the state it names agree; one torn by a crash is
skipped, and the one before it (kept until the next is complete) is used. It
loads with ``weights_only=True``, like any checkpoint.

The cost at the step boundary is small: the model's buffers (which the next
forward updates) are copied at once, the parameters and optimizer state in a
background thread while the next step's forward and backward run, into buffers
allocated once (pinned on CUDA, copied on a side stream). Before the next
optimizer update the loop waits for that copy (:meth:`SnapshotWriter.before_update`);
the serialisation into shared memory then goes on in the background. At most
one snapshot is in flight: a step that comes while one is still being written
is not snapshotted.

Which area is a node's: one directory per (run_dir, run id, host, agent
process), under a root owned by this user (mode 0700), with a marker
``job.json`` naming them. A restarted worker of the same agent finds its
node's area; another job's leftovers sit under another name, and an area whose
marker names another job is ignored (and replaced when this job writes): it is
never loaded. The area is removed when the job completes, is preempted (its
disk checkpoint of that step is saved first) or fails on its last attempt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.state.checkpoint import StagingBuffer, state_bytes
from service.state.checkpoint_io import prune, read_small, write_checkpoint

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, Any]]
MARKER = "job.json"
KEEP = 1  # complete snapshots kept; the one being written is the second


@dataclass(frozen=True)
class Area:
    """One node's snapshot directory for one job, and the marker that says whose it is."""

    path: Path
    owner: dict[str, Any]

    def problem(self) -> str | None:
        """Why this area must not be read (None: it is this job's, or it does not exist yet)."""
        for directory in (self.path.parent, self.path):
            try:
                info = os.lstat(directory)
            except FileNotFoundError:
                return None
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                return (f"{directory} is not a directory of this user with mode 0700; nothing in it is read "
                        "(remove it if you did not make it)")  # fmt: skip
        try:
            raw = read_small(self.path, MARKER, 4096)
            marker = json.loads(raw) if raw is not None else None
        except FileNotFoundError:
            return f"{self.path} has no {MARKER}; it is not a snapshot area of this job"
        except ValueError as exc:
            return f"its {MARKER} is not readable ({exc})"
        if marker != self.owner:
            return f"its {MARKER} names another job ({marker!r}); this job is {self.owner!r}"
        return None

    def readable(self) -> Path | None:
        """The directory to resume from, when it exists and is this job's; a warning when it is not."""
        if not self.path.exists():
            return None
        why = self.problem()
        if why is not None:
            log.warning("ignoring the snapshots in %s: %s", self.path, why)
            return None
        return self.path

    def prepare(self) -> None:
        """Make the root and the area (mode 0700) and write the marker; an area of another job is emptied first."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.exists() and self.problem() is not None:
            shutil.rmtree(self.path)
        self.path.mkdir(mode=0o700, exist_ok=True)
        marker = self.path / MARKER
        if not marker.exists():
            temporary = self.path / f".{MARKER}.{os.getpid()}.tmp"
            temporary.write_text(json.dumps(self.owner))
            os.replace(temporary, marker)
        why = self.problem()
        if why is not None:
            raise OSError(why)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def node_area(root: str, run_dir: str, run_id: str | None, host: str | None = None,
              agent: int | None = None) -> Area | None:  # fmt: skip
    """This node's area for this job, or None without a run id (nothing restarts such a process in place).

    ``agent``: the process that restarts this worker (its parent: torchrun's agent, or slurmstepd).
    """
    if not run_id:
        return None
    owner = {
        "run_dir": str(Path(run_dir).resolve()),
        "run_id": run_id,
        "host": host or socket.gethostname(),
        "agent": os.getppid() if agent is None else agent,
    }
    key = hashlib.sha256(json.dumps(owner, sort_keys=True).encode()).hexdigest()[:24]
    return Area(areas_root(root) / key, owner)


def areas_root(root: str | Path) -> Path:
    """Where this user's snapshot areas lie under ``checkpoint.snapshot_dir``."""
    return Path(root) / f"ddp-service-{os.getuid()}"


def list_areas(root: str | Path) -> list[Path]:
    """The directories of this user's snapshot areas under ``root`` (symlinks left out), sorted.

    Raises ``OSError`` when they cannot be listed (``FileNotFoundError`` when there is none yet).
    """
    return sorted(path for path in areas_root(root).iterdir() if path.is_dir() and not path.is_symlink())


def read_owner(area: Path) -> dict[str, Any]:
    """What the marker of ``area`` says: its job (run_dir, run id) and the agent process and host that own it.

    Raises ``FileNotFoundError`` without a marker, ``ValueError`` (whose text says why) for a marker that cannot
    be read or names no agent process and host.
    """
    try:
        raw = read_small(area, MARKER, 4096)
        owner = json.loads(raw) if raw is not None else None
    except ValueError as exc:
        raise ValueError(f"its {MARKER} cannot be read ({exc})") from exc
    if not isinstance(owner, dict) or type(owner.get("agent")) is not int or not isinstance(owner.get("host"), str):
        raise ValueError(f"its {MARKER} names no agent process")
    return owner


def areas_of_agent(root: str, agent: int, host: str | None = None) -> list[Area]:
    """The areas under ``root`` whose marker names ``agent`` on this host: what that agent's workers wrote.

    Only directories of this user with mode 0700 (see :meth:`Area.problem`) and a readable marker count.
    """
    host = host or socket.gethostname()
    found = []
    try:
        paths = list_areas(root)
    except OSError:
        return []
    for path in paths:
        try:
            owner = read_owner(path)
        except (OSError, ValueError):
            continue
        if owner["agent"] == agent and owner["host"] == host:
            area = Area(path, owner)
            if area.problem() is None:
                found.append(area)
    return found


class Snapshots:
    """Keeps nothing: every rank but a node's local rank 0, and jobs with ``checkpoint.snapshot_every=0``."""

    written = 0
    skipped = 0

    def preflight(self, model: torch.nn.Module | Mapping[str, torch.nn.Module]) -> None:
        """Before training: is there room in shared memory for two snapshots of this model (these kept modules)?"""

    def capture(self, global_step: int, state: StateFn) -> None:
        """Called after an optimizer step at which a snapshot is due: start one of this step."""

    def before_update(self) -> None:
        """Called before each optimizer update: the snapshot's copy of the weights must be done by then."""

    def measured(self) -> list[tuple[float, float]]:
        """What each recent snapshot cost, in seconds (waits for one in flight): its time on the training thread
        (its part at the step boundary, the wait for its copy before the next update) and the CPU time of its
        background work (staging, serialisation, checksum, write)."""
        return []

    def recent(self) -> list[tuple[float, float]]:
        """:meth:`measured`'s costs of the snapshots done, without waiting for one in flight (``auto``'s re-checks)."""
        return []

    def discard(self) -> None:
        """The job is over here (completed, preempted with its checkpoint saved, or failed for good)."""

    def abandon(self) -> None:
        """The process leaves at once (``os._exit``) on its last attempt: remove the area, waiting for nothing."""

    def close(self) -> None:
        """Wait for a snapshot in flight and stop the writer; the area stays for a restart."""


class SnapshotWriter(Snapshots):
    """A node's local rank 0: at each step it is called at, the state into this node's area, in the background."""

    def __init__(self, area: Area, config_hash: str, lineage: str | None, cuda: bool) -> None:
        self.area = area
        self.config_hash = config_hash
        self.lineage = lineage
        self.cuda = cuda
        self.written = self.skipped = 0
        self.enabled = True
        self._buffers: dict[str, frozenset[str]] = {}
        self._staging = StagingBuffer(pin=cuda)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._inflight: Future | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._ready: Any = None  # on CUDA: the side stream's event after the copy
        self._side = torch.cuda.Stream() if cuda else None
        self.costs: deque[tuple[float, float]] = deque(maxlen=16)  # per snapshot (see measured)
        self._boundary = self._waited = 0.0  # the snapshot in flight's time on the training thread

    def preflight(self, model: torch.nn.Module | Mapping[str, torch.nn.Module]) -> None:
        modules = {"model": model} if isinstance(model, torch.nn.Module) else dict(model)
        self._buffers = {name: frozenset(key for key, _ in module.named_buffers()) for name, module in modules.items()}
        need = 2 * 3 * state_bytes(modules)
        try:
            self.area.prepare()
            free = shutil.disk_usage(self.area.path).free
        except OSError as exc:
            self._turn_off(f"its area {self.area.path} cannot be used ({exc})")
            return
        if free < need:
            self._turn_off(f"{self.area.path.parent.parent} has {free / 2**20:.1f} MiB free, and two snapshots of "
                           f"this model and its optimizer take up to {need / 2**20:.1f} MiB. Give the node more "
                           "shared memory (docker --shm-size, a Kubernetes emptyDir with medium: Memory), or point "
                           "checkpoint.snapshot_dir at a larger tmpfs")  # fmt: skip

    def _turn_off(self, why: str) -> None:
        self.enabled = False
        log.warning("in-memory snapshots are off on this node: %s. Resume falls back to the disk checkpoints "
                    "(every checkpoint.every_steps); checkpoint.snapshot_every=0 silences this.", why)  # fmt: skip

    def capture(self, global_step: int, state: StateFn) -> None:
        if not self.enabled:
            return
        if self._inflight is not None and not self._inflight.done():
            self.skipped += 1  # at most one in flight: this step is not snapshotted
            return
        self._collect()
        began = time.perf_counter()
        snapshot = state()
        # The next forward updates the buffers (BatchNorm's statistics): copy them now; the rest in the background.
        for name, buffers in self._buffers.items():
            if name in snapshot:
                snapshot[name] = {key: value.detach().clone() if key in buffers else value
                                  for key, value in snapshot[name].items()}  # fmt: skip
        done = None
        if self._side is not None:
            done = torch.cuda.Event()
            done.record()
        self._copied.clear()
        self._inflight = self._thread.submit(self._write, global_step, snapshot, done)
        self._boundary, self._waited = time.perf_counter() - began, 0.0

    def before_update(self) -> None:
        if self._copied.is_set():
            return
        began = time.perf_counter()
        self._copied.wait()
        self._waited += time.perf_counter() - began
        if self._ready is not None:
            torch.cuda.current_stream().wait_event(self._ready)  # on the device: no host sync

    def measured(self) -> list[tuple[float, float]]:
        if self._inflight is not None:
            self._inflight.exception()
            self._collect()
        return list(self.costs)

    def recent(self) -> list[tuple[float, float]]:
        if self._inflight is not None and self._inflight.done():
            self._collect()
        return list(self.costs)

    def _write(self, global_step: int, snapshot: dict[str, Any], done: Any) -> float:
        """Stage, serialise and write the snapshot; returns this thread's CPU seconds for it."""
        cpu = time.thread_time()
        try:
            if self._side is not None:
                with torch.cuda.stream(self._side):
                    self._side.wait_event(done)
                    staged = self._staging.stage(snapshot)
                    self._ready = torch.cuda.Event()
                    self._ready.record(self._side)
            else:
                staged = self._staging.stage(snapshot)
        finally:
            self._copied.set()
        if self._ready is not None:
            self._ready.synchronize()
        first_bad = staged.pop("first_bad", None)  # the loop's non-finite record, copied with the state
        if first_bad is not None and int(first_bad) >= 0:
            self.enabled = False  # never a snapshot of nan weights; the loop stops at its next check
            log.warning("no snapshot of step %d or later: the gradient norm at step %d was not finite",
                        global_step, int(first_bad))  # fmt: skip
            return time.thread_time() - cpu
        started = time.perf_counter()
        write_checkpoint(self.area.path, global_step, staged, self.config_hash, self.lineage, checksum="xxh3_128",
                         zip_crc32=False)  # fmt: skip
        prune(self.area.path, KEEP, global_step)
        self.written += 1
        log.debug("snapshot of step %d written to %s in %.3f s", global_step, self.area.path,
                  time.perf_counter() - started)  # fmt: skip
        return time.thread_time() - cpu

    def _collect(self) -> None:
        """Report a snapshot that failed; a full shared memory turns snapshots off, training goes on."""
        future, self._inflight = self._inflight, None
        error = future.exception() if future is not None else None
        if error is not None:
            self._turn_off(f"the last snapshot failed ({error})")
        elif future is not None:
            self.costs.append((self._boundary + self._waited, future.result()))

    def discard(self) -> None:
        self.close()
        self.area.remove()

    def abandon(self) -> None:
        self.enabled = False
        self.area.remove()

    def close(self) -> None:
        if self._inflight is not None:
            self._inflight.exception()
            self._collect()
        self._thread.shutdown(wait=True)


def build_snapshots(area: Area | None, every: int | str, local_rank: int, config_hash: str, lineage: str | None,
                    cuda: bool) -> Snapshots:  # fmt: skip
    """A writer on each node's local rank 0 when snapshots are on (``every``: a number, or auto) and the job has a
    run id; else nothing."""
    if area is None or not every or local_rank != 0:
        return Snapshots()
    return SnapshotWriter(area, config_hash, lineage, cuda)
