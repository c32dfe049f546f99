"""One start of a job in this process: its world joined, its state agreed, its roles decided; what any loop is
built of (wrap a model, keep state, log scalars, walk the steps) and how a start ends.

The built-in task loop (:mod:`service.loop.train`) and a script's own loop
(:class:`service.Session`) are both written on a :class:`Runtime`: one start-up,
one resume agreement, one step boundary (:mod:`service.loop.stepping`), one
checkpoint layout, one summary. Nothing in here asks for its rank: what differs
per rank lives in the :class:`~service.loop.roles.Roles` built at start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel

from service import early
from service.config import JobConfig
from service.config.errors import Refusal
from service.data.batches import to_device
from service.data.geometry import plan_total_steps
from service.loop.ending import last_attempt, make_summary
from service.loop.kept import STREAM, Carry, Kept
from service.loop.roles import build_roles
from service.loop.window import Window, scalar
from service.model.parallel import unwrap, wrap_model
from service.model.syncbn import tick_collectives
from service.model.wrapped import ServiceDDP
from service.state.checkpoint_io import FORMAT
from service.state.consistency import check_same_config
from service.state.loop_state import LoopState
from service.state.preemption import STATUS_CODES, Preemption, exit_code_of
from service.state.resume import agree_on_checkpoint, check_compatible, config_hash, fresh_lineage, job_lineage
from service.state.resume import rng_state as saved_rng_state
from service.state.snapshot import node_area
from service.state.snapshot_interval import SnapshotSchedule, usable_cpus
from service.telemetry.goodput import StartTimes
from service.telemetry.metrics import StepReport
from service.telemetry.progress import Progress
from service.telemetry.startup import StartupMarks
from service.telemetry.watchdog import Watchdog, watch_compilation
from service.world.distributed import (
    DistContext,
    all_gather_bytes,
    any_rank,
    distributed,
    largest_across,
    sum_across,
)
from service.world.env import WorldInfo
from service.world.orphans import guard_against_orphaning
from service.world.runlock import build_run_dir_guard

if TYPE_CHECKING:
    from service.data.feeds import MapFeed, StreamFeed
    from service.model.nonfinite import NonfiniteGuard

log = logging.getLogger("service.loop.train")


class WrapError(TypeError):
    """A module handed to ``model`` cannot be wrapped as given; the message names the call and the fix."""


class UsageError(WrapError):
    """A call of the run's API in the wrong order (training before anything is kept) or with data that does not
    fit this run (another dataset); the message names the call and the fix. A ``WrapError`` only so that code
    that caught these as one before still does."""


class Runtime:
    """A start of a job: build it with :meth:`opened` (the lock, the process group, then this)."""

    def __init__(self, config: JobConfig, world: WorldInfo, dist_ctx: DistContext, preemption: Preemption,
                 terminal: bool = False, label: str | None = None, imported: float | None = None) -> None:  # fmt: skip
        self.config, self.world, self.dist_ctx, self.preemption = config, world, dist_ctx, preemption
        self.label = label or config.task
        self.device = dist_ctx.device
        self.control = dist_ctx.control
        self._mark_start(imported)
        check_same_config(config, world.world_size, self.control)
        self.startup.mark("config_agreed")
        preemption.connect(any_rank(self.control))
        torch.manual_seed(config.seed)
        self._agree_on_checkpoint()
        self.digest = config_hash(config)
        self.config_json = config.model_dump(mode="json")
        self.state = LoopState(**self.resumed.state["loop"]) if self.resumed else LoopState()
        self.progress = Progress(self.state.global_step)
        times = StartTimes.of(dist_ctx.began, dist_ctx.up, self.restore_seconds, self.state.global_step,
                              world.started_for)  # fmt: skip
        self.roles = build_roles(config, world, config_hash=self.digest, device_is_cuda=dist_ctx.is_cuda,
                                 resumed=self.resumed, lineage=self.lineage, backend=dist_ctx.backend,
                                 terminal=terminal, snapshot_area=self.area, startup=times)  # fmt: skip
        self.kept = Kept(self.resumed.state if self.resumed else None, world.rank, world.world_size,
                         str(self.resumed.file) if self.resumed else "")  # fmt: skip
        self.snapshot_schedule = self._snapshot_schedule()
        self.window = Window(self.device, sum_across(self.control),
                             lambda payload: all_gather_bytes(payload, self.control, world.world_size))  # fmt: skip
        self._loop_fields()
        abandon = self.roles.snapshots.abandon if last_attempt(world) else lambda: None
        self.watchdog = Watchdog.for_job(config, world, dist_ctx, self.progress, preemption, self.roles.sink, abandon)
        self.watchdog.start()
        self.startup.mark("runtime")

    def _mark_start(self, imported: float | None) -> None:
        """summary.json's startup: each phase's end, from the process's start (the entry, the imports, the group)."""
        times = StartTimes.of(self.dist_ctx.began, self.dist_ctx.up, 0.0, 0, self.world.started_for)
        self.startup = StartupMarks(times.process_start)
        for name, at in (("entry", early.started()), ("imports", imported), ("group_began", self.dist_ctx.began),
                         ("group_up", self.dist_ctx.up)):  # fmt: skip
            if at is not None:
                self.startup.mark(name, at)

    def _agree_on_checkpoint(self) -> None:
        """The ranks agree on the checkpoint (or snapshot) to resume from, if any; the job's lineage."""
        config, world = self.config, self.world
        checkpoints = Path(config.run_dir) / "checkpoints"
        own = job_lineage(world.run_id) if config.checkpoint.resume == "never" else None  # never: this job's only
        self.area = node_area(config.checkpoint.snapshot_dir, config.run_dir, world.run_id, agent=world.agent_pid)
        agreeing = time.perf_counter()  # the resume's time, for the goodput ledger: the agreement and the loads
        self.resumed = agree_on_checkpoint(checkpoints, world.rank, world.world_size, self.control,
                                           config.checkpoint.resume, own,
                                           self.area.readable() if self.area else None)  # fmt: skip
        self.restore_seconds = time.perf_counter() - agreeing if self.resumed is not None else 0.0
        self.startup.mark("resume_agreed")
        if self.resumed is not None:
            check_compatible(self.resumed, config)
        # The job's lineage, the same on every rank: every checkpoint and snapshot carries it, whichever rank
        # writes it (a survivor of a lost node writes the next ones; its restarts under resume=never look for it).
        self.lineage = own or (self.resumed.state.get("lineage") if self.resumed else fresh_lineage(self.control))

    def _snapshot_schedule(self) -> SnapshotSchedule:
        """The steps the in-memory snapshots are taken at: the same on every rank (measured, agreed)."""
        return SnapshotSchedule(
            self.config.checkpoint.snapshot_every, self.state.global_step, self.roles.snapshots.measured,
            agree=largest_across(self.control),
            sync=torch.cuda.synchronize if self.dist_ctx.is_cuda else lambda: None,
            ranks_here=self.world.local_world_size, cpus=usable_cpus(),
            max_seconds=self.config.checkpoint.snapshot_max_seconds, ran=lambda: self.progress.tick,
            recent=self.roles.snapshots.recent,
        )  # fmt: skip

    def _loop_fields(self) -> None:
        """What a loop fills in: its models, its feed, its plan, how it ended."""
        self.models: list[nn.Module] = []
        self.feed: MapFeed | StreamFeed | None = None
        self.total_steps = 0
        self.nonfinite: NonfiniteGuard | None = None  # the task loop's: its checkpoints are never of nan weights
        self.stopped: str | None = None  # why the steps ended early: "preempted" or "lock_lost"
        self.in_flight: Any = None  # the step a loop is running (yielded, not yet counted)
        self.started = time.perf_counter()
        self.start_samples = self.state.samples_seen
        self.summary: dict[str, Any] | None = None
        self.last_report: StepReport | None = None  # the last log line's numbers (a script's are its summary's)
        self.evaluated: dict[str, float] = {}  # a script's s.log outside a step: its latest world means
        self.resize_advice = "set train.global_batch_size to keep it constant across resizes"
        self._rank_kept: dict[str, Any] = {}

    @classmethod
    @contextlib.contextmanager
    def opened(cls, config: JobConfig, world: WorldInfo, preemption: Preemption, terminal: bool = False,
               label: str | None = None) -> Iterator[Runtime]:  # fmt: skip
        """The orphan guard, run_dir's lock and the process group, then a :class:`Runtime` in them; on the way out
        the runtime lets go of what holds the group (its wrapped models) before the group is destroyed."""
        imported = time.time()  # torch and the service are loaded by now
        guard_against_orphaning(world)  # before anything that could outlive a dead agent
        guard = build_run_dir_guard(config, world)
        with guard.held(), distributed(world, config.dist.backend, config.dist.timeout_seconds) as dist_ctx:
            runtime = cls(config, world, dist_ctx, preemption, terminal, label, imported)
            try:  # a lost run_dir lock fences the writers first, then stops every rank at the next agreed step
                with guard.on_lost(lambda why: runtime.roles.fence(guard.vacant), preemption.lose_lock):
                    yield runtime
            finally:
                runtime.close()

    # ------------------------------------------------------------------ models and what is kept
    def model(self, module: nn.Module, call: str = "s.model") -> nn.Module:
        """``module`` on the device, SyncBatchNorm as configured, compiled when asked, in DDP (the settle step at
        its first forward, the watchdog's marks)."""
        if not isinstance(module, nn.Module):
            raise WrapError(f"{call}(...) got a {type(module).__name__}, not a torch.nn.Module; pass your model.")
        if any(module is model or module is unwrap(model) for model in self.models):
            raise WrapError(f"{call}(...) got a model it wrapped already (or the wrapper it returned); wrap each "
                            "model once and use the wrapper that first call returned.")  # fmt: skip
        if isinstance(module, (DataParallel, nn.parallel.DistributedDataParallel)):
            raise WrapError(f"{call}(...) got a module already wrapped in {type(module).__name__}; pass the plain "
                            f"module ({call} moves it to the device, converts its BatchNorm and wraps it itself), "
                            "e.g. the .module of your wrapper.")  # fmt: skip
        if self.feed is not None:
            raise UsageError(
                f"{call}(...) came after training started (the first s.batches); wrap every model "
                "before it, so that its state is kept and restored before the first step."
            )
        wrapped = wrap_model(module, self.config.train, self.config.ddp, self.world, self.device)
        watch_compilation(self.progress)  # DDP and train.compile load dynamo: its compilations are progress now
        if isinstance(wrapped, ServiceDDP):
            wrapped.watch(self.progress)
        tick_collectives(wrapped, self.progress.collective)
        self.roles.sink.instrument(wrapped)  # e.g. a comm hook that times DDP's all-reduce
        self.models.append(wrapped)
        return wrapped

    def keep(self, objects: Mapping[str, Any], per_rank: bool = False, call: str = "s.keep") -> None:
        """Keep ``objects`` (shared, or each rank's own) in every checkpoint and snapshot; restore them now on a
        resume. A :class:`Carry` brings its value back onto this device."""
        for obj in objects.values():
            if isinstance(obj, Carry) and obj.on_load is None:
                obj.on_load = lambda value: to_device(value, self.device)
        restoring = time.perf_counter()
        self.kept.keep(objects, per_rank, call)
        if self.resumed is not None:
            self.restore_seconds += time.perf_counter() - restoring

    def log(self, scalars: Mapping[str, Any], call: str = "s.log") -> None:
        """Add named scalars to this log window (world means at the next log line, TensorBoard, Prometheus)."""
        for name, value in scalars.items():
            self.window.log(name, scalar(name, value, call))

    def lr(self) -> float | None:
        """The learning rate of the first kept optimizer (the log line's), or None without one."""
        for obj in self.kept.shared.values():
            if isinstance(obj, torch.optim.Optimizer) and obj.param_groups:
                return float(obj.param_groups[0]["lr"])
        return None

    # ------------------------------------------------------------------ the data, once known
    def plan(self, feed: MapFeed | StreamFeed) -> int:
        """The run's optimizer steps with this feed (a task's schedule needs them before its first step). A run
        that completed (however it ended: its last step, a script's ``break``) ends where it did, unless
        ``train.max_steps`` went up since: its rerun trains nothing."""
        state = self.state
        if state.completed and self.resumed is not None:
            saved = self.resumed.state.get("config", {}).get("train", {}).get("max_steps")
            if saved == self.config.train.max_steps:
                log.info("this run completed at step %d: nothing to train (raise train.max_steps to train on)",
                         state.global_step)  # fmt: skip
                self.total_steps = state.global_step
                return self.total_steps
            state.completed = False  # trained on: a stop from here on is no completion
        self.total_steps = plan_total_steps(feed, state, self.config.train)
        return self.total_steps

    def begin(self, feed: MapFeed | StreamFeed, call: str) -> None:
        """Training starts with ``feed``: nothing more is kept; room for the saves; the saved RNG back."""
        from service.data.feeds import check_stream

        if self.feed is feed:
            return
        if self.feed is not None:  # another dataset object: the same data made anew (a range each epoch) is fine
            if feed.signature() != self.feed.signature():
                raise UsageError(f"{call}: this run trains on one dataset, and another came ({feed.signature()} after "
                                f"{self.feed.signature()}: kind, length, step size, ...); pass the same data with "
                                "the same batch_size, shuffle, shard and drop_last to every s.batches call of a "
                                "session.")  # fmt: skip
            self.feed = feed
            return
        if feed.stream:
            saved = (self.kept.saved_own() or {}).get(STREAM)
            check_stream(feed, self.config.train.max_steps, self.config.train.epochs,  # type: ignore[arg-type]
                         self.resumed.state if self.resumed else None, saved, self.world.world_size,
                         self.config.data.stream_resume)  # fmt: skip
            self.kept.per_rank[STREAM] = feed
        if not self.kept.shared and not self.kept.per_rank:
            raise UsageError(f"{call} came before any s.keep(...): nothing would be in the checkpoints, and a resume "
                            "would start your models afresh. Keep them first: s.keep(model=model, "
                            "optimizer=optimizer).")  # fmt: skip
        self.kept.close(call)
        self.feed = feed
        if not self.total_steps:
            self.plan(feed)
        self.roles.sink.on_plan(self.total_steps)
        modules = {name: obj for name, obj in self.kept.shared.items() if isinstance(obj, nn.Module)}
        self.roles.checkpointer.preflight(modules)  # rank 0: room for a checkpoint, before any training
        self.roles.snapshots.preflight(modules)  # each node's local rank 0: room in shared memory, or none kept
        if self.area is not None and self.config.checkpoint.snapshot_every:
            log.info("in-memory snapshots (checkpoint.snapshot_every): %s", self.snapshot_schedule.describe())
        resumed = self.resumed
        if resumed is not None:
            rng = resumed.state["rng"]
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            saved_batch = resumed.state.get("global_batch")
            if saved_batch is not None and saved_batch != feed.global_batch:
                log.warning("the global batch changes from %d (world size %s) to %d (world size %d) at step %d; %s",
                            saved_batch, resumed.state.get("world_size"), feed.global_batch, self.world.world_size,
                            resumed.step, self.resize_advice)  # fmt: skip
        self.roles.goodput.restored(self.restore_seconds)
        self.started = time.perf_counter()  # summary.json's wall_seconds and samples_per_second: the training's own

    # ------------------------------------------------------------------ saving
    def gather_own(self) -> None:
        """Every rank's own kept objects (and stream position) to every rank, for a save that may come now. A
        collective: called on every rank at the same steps; nothing to do without such objects."""
        if self.kept.per_rank:
            payloads = all_gather_bytes(self.kept.own_payload(), self.control, self.world.world_size)
            self._rank_kept = self.kept.gathered(payloads)

    def checkpoint_state(self, checked: bool = True) -> dict[str, Any]:
        """Everything a resume needs; only tensors and plain containers, so it loads with weights_only=True.

        ``checked=False``, for an in-memory snapshot at every step: the task loop's non-finite record is not
        read on the host here (no device sync per step); it goes along as ``first_bad``, and the snapshot's
        writer drops a state recorded bad, off the training thread.
        """
        from service.version import __version__

        extra: dict[str, Any] = {}
        if self.nonfinite is not None:
            if checked:
                self.nonfinite.raise_if_bad()  # never a checkpoint of nan weights
            else:
                extra["first_bad"] = self.nonfinite.first_bad
        return {
            **extra,
            "format": FORMAT,
            **self.kept.states(),
            **({"rank_kept": self._rank_kept} if self._rank_kept else {}),
            "loop": dataclasses.asdict(self.state),
            "rng": saved_rng_state(),
            "world_size": self.world.world_size,
            "global_batch": self.feed.global_batch if self.feed is not None else None,
            "config": self.config_json,
            "config_hash": self.digest,
            "lineage": self.lineage or self.roles.checkpointer.lineage,
            "versions": {"torch": str(torch.__version__), "service": __version__},
        }

    def save_due(self, step: int) -> bool:
        """After a step: a periodic checkpoint and a snapshot when due (rank 0, each node's local rank 0). On every
        rank at every step: the snapshot schedule agrees on its interval here once (``auto``). Whether either was
        due (a save's time on this thread is then the sinks' checkpoint stall)."""
        every_steps = self.config.checkpoint.every_steps
        snapshot = self.snapshot_schedule.due(step)
        due = snapshot or bool(every_steps and step % every_steps == 0)
        if due:
            self.gather_own()
        self.roles.checkpointer.maybe_save(step, self.checkpoint_state)
        if snapshot:
            self.roles.snapshots.capture(step, lambda: self.checkpoint_state(checked=False))
        return due

    # ------------------------------------------------------------------ the end
    def finish(self, status: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The end of this start: the last checkpoint (completed or preempted), every rank past rank 0's save,
        the snapshots gone, and ``summary.json``."""
        from service.telemetry.progress import CHECKPOINT

        self.progress.mark(CHECKPOINT)
        self.preemption.settle()  # a check the last steps started: every rank reads it before the saves
        saving = time.perf_counter()
        if status != "lock_lost":
            self.gather_own()
        ends = status == "completed" and not self.state.completed  # a checkpoint of this step may lack the mark
        self.state.completed = self.state.completed or status == "completed"
        self.roles.checkpointer.save(self.state.global_step, self.checkpoint_state, again=ends)
        self.roles.sink.on_checkpoint_stall(time.perf_counter() - saving)
        if status == "preempted":
            dist.barrier(group=self.control)  # nobody leaves before rank 0's checkpoint of this step is on disk
        self.roles.snapshots.discard()  # completed, or its checkpoint is saved, or run_dir is another job's now
        return self._summarize(status, extra, error=self.preemption.lock_lost, code=STATUS_CODES[status])

    def fail(self, exc: BaseException, extra: Mapping[str, Any] | None = None, error: str | None = None) -> None:
        """A start that raised: its snapshots go when no restart will read them; ``status: failed`` is written,
        naming the first rank that failed and its own error (this one's may be the broken connection it left), with
        the exit status ``exc`` gives (a script's ``sys.exit(3)``: 3). Bad input refused before training
        (:class:`~service.config.errors.Refusal`) is logged on every rank, and nothing is written."""
        if isinstance(exc, Refusal):
            log.error("%s", exc)
            return
        own = error or f"{type(exc).__name__}: {exc}"
        rank, first = self.watchdog.first_failure(own)
        if rank != self.world.rank:
            log.error("rank %d failed first: %s (this rank's own error came after it: %s)", rank, first, own[:500])
        if last_attempt(self.world):
            self.roles.snapshots.discard()
        with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped training
            self._summarize("failed", {"failed_rank": rank, **(extra or {})}, error=first, code=exit_code_of(exc))

    def _summarize(self, status: str, extra: Mapping[str, Any] | None, error: str | None,
                   code: int) -> dict[str, Any]:  # fmt: skip
        seconds = time.perf_counter() - self.started
        summary = make_summary(self, status, seconds, self.state.samples_seen - self.start_samples, error)
        summary["exit_code"] = code
        summary.update(extra or {})
        self.roles.summary.write(summary)
        self.summary = summary
        return summary

    def close(self) -> None:
        """Stop the watchdog and the roles' threads and files; let go of the models (the group is destroyed next)."""
        self.watchdog.stop()
        try:
            self.roles.close()
        finally:
            for model in self.models:
                if isinstance(model, ServiceDDP):
                    model.release()
            self.models.clear()
            self.kept.shared.clear()
            self.kept.per_rank.clear()
            self.feed = None
