"""The job the loop runs (:class:`Job`, built once by ``train.build_job``), where it stands
(:class:`LoopState`), and what ``summary.json`` says of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from service.config import JobConfig
from service.loop.nonfinite import NonfiniteGuard
from service.loop.optim import LRSchedule
from service.loop.parallel import unwrap
from service.loop.precision import Precision
from service.loop.progress import Progress
from service.loop.roles import Roles
from service.loop.sampler import DataPlan, PlanSampler
from service.loop.steps import TaskStep
from service.loop.watchdog import Watchdog
from service.state.checkpoint_io import FORMAT
from service.state.preemption import Preemption
from service.state.resume import Resumed, rng_state
from service.tasks.base import Task
from service.telemetry.summary import model_digest
from service.world.env import WorldInfo

if TYPE_CHECKING:
    from service.telemetry.metrics import EvalReport


@dataclasses.dataclass
class LoopState:
    """Where training stands; what a checkpoint must hold to resume.

    ``cursor`` is the data position: samples of this epoch's permutation that
    optimizer steps have consumed, whatever the world size that consumed them.
    """

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    epochs_completed: int = 0
    cursor: int = 0


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything the loop needs, built once by :func:`build_job`."""

    config: JobConfig
    world: WorldInfo
    device: torch.device
    task: Task
    step: TaskStep
    eval_names: list[str]
    model: nn.Module
    params: list[torch.Tensor]  # the model's, listed once: walking its modules every step costs ~50 µs
    optimizer: torch.optim.Optimizer
    scheduler: LRSchedule
    plan: DataPlan
    sampler: PlanSampler
    loader: DataLoader
    eval_loader: DataLoader
    roles: Roles
    preemption: Preemption
    nonfinite: NonfiniteGuard
    barrier: Callable[[], None]
    state: LoopState
    resumed: Resumed | None
    total_steps: int
    world_sum: Callable[[Sequence[float]], list[float]]  # a collective over the control group: host numbers summed
    precision: Precision
    config_json: dict[str, Any]  # the config as a checkpoint holds it, and its hash: made once, saved at every step
    config_digest: str
    progress: Progress  # where the main thread stands: the loop marks it, the watchdog reads it
    lineage: str | None  # the job's lineage, known on every rank (None only after a resume from a pre-lineage one)
    watchdog: Watchdog

    @property
    def autocast(self) -> Callable[[], contextlib.AbstractContextManager]:
        return self.precision.autocast


def make_summary(job: Job, state: LoopState, report: EvalReport | None, seconds: float, trained: int,
                 status: str, error: str | None = None) -> dict[str, Any]:  # fmt: skip
    """What ``summary.json`` holds; ``samples_per_second`` counts what this start trained, not the samples before
    the resumed step."""
    return {
        "status": status,
        "stopped_at_step": state.global_step if status != "completed" else None,
        "error": error,
        "resumed_from": job.resumed.describe() if job.resumed else None,
        "task": job.config.task,
        "model_digest": model_digest(unwrap(job.model).state_dict()),
        "global_step": state.global_step,
        "total_steps": job.total_steps,
        "samples_seen": state.samples_seen,
        "epochs_completed": state.epochs_completed,
        "world_size": job.world.world_size,
        "global_batch_size": job.plan.global_batch,
        "grad_accum": job.plan.micro_steps,
        "restarts": job.world.restart_count,
        "nonfinite_steps": job.nonfinite.skipped,
        "final_loss": report.loss if report else None,
        "eval_metric": {"name": job.step.headline(job.eval_names), "value": report.metric if report else None},
        "eval_metrics": dict(report.metrics) if report else {},
        "checkpoint": {
            "last": str(job.roles.checkpointer.last_path or "") or None,
            "failures": job.roles.checkpointer.failures,
            "best": job.roles.checkpointer.best.describe() if job.roles.checkpointer.best else None,
        },
        "snapshots": {"written": job.roles.snapshots.written, "skipped": job.roles.snapshots.skipped},
        "goodput": job.roles.goodput.finish(status),  # rank 0: the job's breakdown over every start (None else)
        "wall_seconds": round(seconds, 3),
        "samples_per_second": round(trained / seconds, 2) if seconds > 0 else None,
        "launcher": job.world.launcher,
        "scheduler": job.world.scheduler,
        "device": job.device.type,
    }


def checkpoint_state(job: Job, state: LoopState, checked: bool = True) -> dict[str, Any]:
    """Everything a resume needs; only tensors and plain containers, so it loads with weights_only=True.

    ``checked=False``, for an in-memory snapshot at every step: the non-finite record is not read on the host
    here (no device sync per step); it goes along as ``first_bad``, and the snapshot's writer drops a state
    recorded bad, off the training thread.
    """
    from service import __version__

    if checked:
        job.nonfinite.raise_if_bad()  # never a checkpoint of nan weights
    extra = {} if checked else {"first_bad": job.nonfinite.first_bad}
    return {
        **extra,
        "format": FORMAT,
        "model": unwrap(job.model).state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "scaler": job.precision.state_dict(),  # None unless train.amp=fp16
        "loop": dataclasses.asdict(state),
        "rng": rng_state(),
        "world_size": job.world.world_size,
        "global_batch": job.plan.global_batch,
        "config": job.config_json,
        "config_hash": job.config_digest,
        "lineage": job.lineage or job.roles.checkpointer.lineage,
        "versions": {"torch": str(torch.__version__), "service": __version__},
    }
