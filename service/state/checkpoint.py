"""Who saves checkpoints and when: rank 0, every N steps, at the end and on preemption; the others never.

The file format and its atomic write live in :mod:`service.state.checkpoint_io`.
With ``checkpoint.async`` the periodic saves are staged into reused CPU
buffers (pinned on CUDA) at the step boundary and written by one background
thread while training goes on; at most one save is in flight. Saves at the end
and on preemption are synchronous. A failed save, in the foreground or the
background, leaves the previous checkpoints valid; ``checkpoint.on_error``
decides whether training stops (the default) or goes on.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from service.state.best import BestRecord, BestRule, read_best, write_best
from service.state.checkpoint_io import (
    CheckpointWriteError,
    candidate_steps,
    describe_write_error,
    nearest_existing,
    prune,
    read_manifest,
    state_name,
    write_checkpoint,
)

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, Any]]


class Checkpointer:
    """Saves nothing: what every rank but 0 gets (it still checks that ``checkpoint.best`` names a result)."""

    failures = 0
    last_path: Path | None = None
    lineage: str | None = None
    best: BestRecord | None = None

    def __init__(self, best_rule: BestRule | None = None) -> None:
        self.best_rule = best_rule

    def preflight(self, model: torch.nn.Module | Mapping[str, torch.nn.Module]) -> None:
        """Before training: is there room for a checkpoint of this model (or of these kept modules)?"""

    def maybe_save(self, global_step: int, state: StateFn) -> None:
        """Called at every optimizer step; also reports a background save that failed."""

    def save(self, global_step: int, state: StateFn, again: bool = False) -> None:
        """A synchronous save (end of run, preemption); waits for one in flight first. ``again``: write it even when
        this step is saved already (the run's end marks the state completed)."""

    def close(self) -> None:
        """Wait for a save in flight and stop the writer."""

    def fence(self) -> None:
        """Save nothing more: run_dir's lock was lost, another job may own the directory now."""

    def check_metrics(self, names: Sequence[str]) -> None:
        """Before training: ``checkpoint.best`` ranks by one of the names the evaluation will report."""
        if self.best_rule is not None:
            self.best_rule.value_of(dict.fromkeys(names, 0.0))

    def on_eval(self, global_step: int, results: Mapping[str, float], state: StateFn) -> None:
        """After each evaluation (``results``: name → value): keep this step's checkpoint if it is the best so far."""
        if self.best_rule is not None:
            self.best_rule.value_of(results)  # an unknown metric fails on every rank at the first evaluation


def state_bytes(model: torch.nn.Module | Mapping[str, torch.nn.Module]) -> int:
    """Bytes of the state dict of a module, or of every module of a mapping (a loop's kept modules)."""
    modules = [model] if isinstance(model, torch.nn.Module) else list(model.values())
    return sum(t.numel() * t.element_size() for module in modules for t in module.state_dict().values())


class StagingBuffer:
    """A snapshot of a state dict in CPU tensors that are allocated once and reused."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}

    def stage(self, value: Any, path: str = "") -> Any:
        if isinstance(value, torch.Tensor):
            buffer = self.tensors.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=self.pin)
                self.tensors[path] = buffer
            buffer.copy_(value.detach(), non_blocking=self.pin)
            return buffer
        if isinstance(value, dict):
            return {key: self.stage(item, f"{path}/{key}") for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.stage(item, f"{path}/{index}") for index, item in enumerate(value))
        return value


class Rank0Checkpointer(Checkpointer):
    def __init__(self, directory: Path, every_steps: int, keep: int, config_hash: str, on_error: str,
                 async_save: bool, start_fresh: bool = False, pin: bool = False,
                 saved_step: int | None = None, lineage: str | None = None,
                 on_save: Callable[[float, bool], None] | None = None,
                 best_rule: BestRule | None = None, resumed: bool | None = None) -> None:  # fmt: skip
        """``saved_step``: the step resumed from when run_dir holds it; ``resumed``: this start resumed (from disk
        or from an in-memory snapshot; default: ``saved_step`` is set)."""
        super().__init__(best_rule)
        resumed = saved_step is not None if resumed is None else resumed
        self.on_save = on_save  # (seconds, ok) after each write, from the writer thread for background saves
        self.directory = directory
        self.every_steps = every_steps
        self.keep = keep
        self.config_hash = config_hash
        self.on_error = on_error
        self.saved_step = saved_step  # the step resumed from is on disk, valid, and needs no rewrite
        self.failures = 0
        self.last_path = directory / state_name(saved_step) if saved_step is not None else None
        self._staging = StagingBuffer(pin) if async_save else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if async_save else None
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self._lock = threading.Lock()
        self.fenced = False
        self._writing = threading.Lock()  # held by a write and its pruning; a fence waits for one in progress
        # A resume carries the lineage on; a fresh start (or one from a checkpoint older than lineages) makes one.
        self.lineage = lineage or uuid.uuid4().hex
        self._lineages = {self.lineage, *([None] if resumed and lineage is None else [])}
        if start_fresh:
            archive_existing(directory)
        self._pointed: int | None = None  # the step best.json names on disk: pruning spares it until it is replaced
        self.best = self._carried_best() if best_rule is not None and resumed else None

    def _carried_best(self) -> BestRecord | None:
        """The best so far of the run this one resumes (``best.json``), when it ranks by the same rule."""
        rule = self.best_rule
        try:
            record = read_best(self.directory)
            if record is not None:
                read_manifest(self.directory, record.step)  # its checkpoint is still there
        except ValueError as exc:
            log.warning("not carrying on the best checkpoint: %s; the next evaluation starts a new best", exc)
            return None
        if record is None or rule is None or record.lineage not in self._lineages:
            return None
        self._pointed = record.step
        if (record.metric, record.mode) != (rule.metric, rule.mode):
            log.warning("checkpoint.best changed from %s/%s to %s/%s: the next evaluation starts a new best "
                        "(step %d stays the best until then)", record.metric, record.mode, rule.metric,
                        rule.mode, record.step)  # fmt: skip
            return None
        log.info("best checkpoint so far: step %d, %s %.6g", record.step, record.metric, record.value)
        return record

    def preflight(self, model: torch.nn.Module | Mapping[str, torch.nn.Module]) -> None:
        """Refuse to start when the next checkpoint cannot fit: the model, and up to two optimizer slots per weight."""
        need = 3 * state_bytes(model)
        free = shutil.disk_usage(nearest_existing(self.directory)).free
        if free < need:
            raise CheckpointWriteError(
                f"run_dir's checkpoint directory {self.directory} has {free / 2**20:.1f} MiB free, but a checkpoint "
                f"of this model and its optimizer takes up to {need / 2**20:.1f} MiB. Free space there or point "
                "run_dir at a larger volume; nothing was trained."
            )

    def maybe_save(self, global_step: int, state: StateFn) -> None:
        self._report_background()
        if self.fenced or not self.every_steps or global_step % self.every_steps or global_step == self.saved_step:
            return  # (saved already: checkpoint.best kept this step when it was evaluated)
        staging, writer = self._staging, self._writer
        if staging is None or writer is None:
            self._write(global_step, state())
            return
        self._wait()
        self._report_background()  # the save before this one may have failed while we waited for it
        started = time.perf_counter()
        staged = staging.stage(state())
        ready = torch.cuda.Event() if staging.pin else None
        if ready is not None:
            ready.record()
        self._inflight_step = global_step
        self._inflight = writer.submit(self._write_staged, global_step, staged, ready)
        log.info("checkpoint step %d staged in %.3f s; writing in the background", global_step,
                 time.perf_counter() - started)  # fmt: skip

    def save(self, global_step: int, state: StateFn, again: bool = False) -> None:
        self._wait()
        future, self._inflight, self._inflight_step = self._inflight, None, None
        if future is not None and future.exception() is not None:
            log.error("the background save failed (%s); saving step %d now", future.exception(), global_step)
        if self.saved_step == global_step and not again:
            return  # this process wrote this very step already; the weights have not moved since
        if self.fenced:
            log.error("not saving step %d: this job lost the run_dir lock, %s may be another job's now", global_step,
                      self.directory)  # fmt: skip
            return
        self._write(global_step, state())

    def close(self) -> None:
        self._wait()
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def fence(self) -> None:
        with self._writing:  # once this returns, nothing more is written or pruned
            self.fenced = True

    def on_eval(self, global_step: int, results: Mapping[str, float], state: StateFn) -> None:
        rule = self.best_rule
        if rule is None:
            return
        value = rule.value_of(results)
        if self.fenced or not rule.improves(value, self.best):
            return
        self._wait()  # a background save of this very step may be in flight
        self._report_background()
        if self.saved_step != global_step:
            self._write(global_step, state())
            if self.saved_step != global_step:  # the save failed under on_error=continue, or a fence
                log.error("step %d is the best so far (%s %.6g) but its checkpoint was not saved", global_step,
                          rule.metric, value)  # fmt: skip
                return
        record = rule.record(global_step, value, self.lineage)
        with self._writing:
            if self.fenced:
                return
            try:
                write_best(self.directory, record)
            except OSError as exc:
                with self._lock:
                    self.failures += 1
                self._handle(CheckpointWriteError(describe_write_error(exc, self.directory / "best.json")))
                return
            previous, self.best, self._pointed = self.best, record, global_step
            prune(self.directory, self.keep, global_step, self._lineages, self._protected())
        log.info("best checkpoint: step %d (%s %.6g%s)", global_step, rule.metric, value,
                 f", was step {previous.step} with {previous.value:.6g}" if previous else "")  # fmt: skip

    def _protected(self) -> tuple[int, ...]:
        return (self._pointed,) if self._pointed is not None else ()

    def _write_staged(self, global_step: int, staged: dict[str, Any], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()
        self._write(global_step, staged, background=True)

    def _write(self, global_step: int, state: dict[str, Any], background: bool = False) -> None:
        with self._writing:
            if not self.fenced:
                self._write_unfenced(global_step, state, background)

    def _write_unfenced(self, global_step: int, state: dict[str, Any], background: bool) -> None:
        started = time.perf_counter()
        try:
            manifest = write_checkpoint(self.directory, global_step, state, self.config_hash, self.lineage)
        except CheckpointWriteError as exc:
            with self._lock:
                self.failures += 1
            self._report(time.perf_counter() - started, False)
            if background:
                raise
            self._handle(exc)
            return
        with self._lock:
            self.saved_step = global_step
            self.last_path = self.directory / manifest.file
        self._report(time.perf_counter() - started, True)
        log.info("checkpoint saved: %s (%.1f MiB in %.2f s%s)", self.last_path, manifest.size / 2**20,
                 time.perf_counter() - started, ", background" if background else "")  # fmt: skip
        prune(self.directory, self.keep, global_step, self._lineages, self._protected())

    def _report(self, seconds: float, ok: bool) -> None:
        if self.on_save is not None:
            self.on_save(seconds, ok)

    def _wait(self) -> None:
        if self._inflight is not None:
            self._inflight.exception()  # blocks until done; the error is reported by _report_background

    def _report_background(self) -> None:
        future, step = self._inflight, self._inflight_step
        if future is None or not future.done():
            return
        self._inflight = self._inflight_step = None
        error = future.exception()
        if error is not None:
            log.error("the background save of step %d failed", step)
            self._handle(error)

    def _handle(self, error: BaseException) -> None:
        if self.on_error == "stop" or not isinstance(error, CheckpointWriteError):
            raise error
        log.error("%s Training goes on (checkpoint.on_error=continue).", error)


def archive_existing(directory: Path) -> Path | None:
    """``checkpoint.resume=never``: move earlier checkpoints aside (nothing is deleted) before this run saves."""
    if not candidate_steps(directory):
        return None
    target = directory.with_name(f"{directory.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('~')[0]}~{suffix}")
    directory.rename(target)
    log.warning("checkpoint.resume=never: moved the earlier checkpoints in %s to %s", directory, target)
    return target
