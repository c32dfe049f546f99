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

Which area is a node's, and why one on a root another user made is never used:
:mod:`service.state.snapshot_area`. The area is removed when the job completes,
is preempted (its disk checkpoint of that step is saved first) or fails on its
last attempt.

A snapshot never ends a job: any failure to take, serialise or write one (a
state that cannot be pickled, a full or read-only shared memory, an area
removed under it) turns snapshots off for the rest of this start, with one
warning naming the cause; training and the disk checkpoints go on.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from service.state.checkpoint import StagingBuffer, state_bytes
from service.state.checkpoint_io import CheckpointWriteError, prune, write_checkpoint
from service.state.snapshot_area import (
    MARKER,
    Area,
    areas_of_agent,
    areas_root,
    list_areas,
    node_area,
    read_owner,
)

log = logging.getLogger(__name__)

__all__ = ["MARKER", "Area", "SnapshotWriter", "Snapshots", "areas_of_agent", "areas_root", "build_snapshots",
           "list_areas", "node_area", "read_owner"]  # fmt: skip

StateFn = Callable[[], dict[str, Any]]
KEEP = 1  # complete snapshots kept; the one being written is the second


class SnapshotFailed(RuntimeError):
    """A snapshot could not be written; the message says why, and the writer turns snapshots off."""


def failure(exc: BaseException, step: int, area: Path) -> str:
    """Why the snapshot of ``step`` failed, for the one warning that turns snapshots off: the disk's error (a full
    or read-only shared memory, an area removed), or what in the state cannot be serialized."""
    cause = exc.__cause__ if isinstance(exc, CheckpointWriteError) else exc
    if isinstance(cause, OSError):
        code = errno.errorcode.get(cause.errno or 0, "")
        return (f"the snapshot of step {step} could not be written into {area}: {cause.strerror or cause}"
                f"{f' ({code})' if code else ''}. Give the node more shared memory, or point "
                "checkpoint.snapshot_dir at a writable tmpfs with room for two snapshots")  # fmt: skip
    first = (str(exc).splitlines() or [""])[0][:300]
    return (f"the state of step {step} could not be serialized ({type(exc).__name__}: {first}); a checkpoint holds "
            "tensors and plain containers only, so keep objects whose state_dict returns nothing else")  # fmt: skip


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
        """Snapshots off for the rest of this start, with one warning naming why; nothing more is submitted."""
        if not self.enabled:
            return
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
        if not self.enabled:  # the last one failed: not this one either
            return
        began = time.perf_counter()
        try:
            snapshot = state()
            # The next forward updates the buffers (BatchNorm's statistics): copy them now; the rest in the
            # background.
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
        except Exception as exc:  # a snapshot never ends the job: the disk checkpoint meets such a state itself
            self._copied.set()
            self._turn_off(failure(exc, global_step, self.area.path))
            return
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
        try:
            write_checkpoint(self.area.path, global_step, staged, self.config_hash, self.lineage,
                             checksum="xxh3_128", zip_crc32=False, create=False)  # fmt: skip
        except Exception as exc:
            raise SnapshotFailed(failure(exc, global_step, self.area.path)) from exc
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
            self._turn_off(str(error) if isinstance(error, SnapshotFailed) else f"the last snapshot failed ({error})")
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
