"""The built-in loop for a ``Task``: build it on a :class:`~service.loop.runtime.Runtime`, then epochs → optimizer
steps → micro-steps, with evaluations.

It is written on the same primitives as a script's own loop (:class:`service.Session`): the runtime wraps the
model, keeps ``model``, ``optimizer``, ``scheduler``, ``scaler`` (and the task's ``state``), and walks the steps
(:func:`service.loop.stepping.steps`), whose boundary saves, logs and stops; what is the task loop's own is its
step (micro-batches, their weights, ``no_sync``, AMP, clipping, the optimizer and schedule) and its evaluations.
Nothing in here asks for its rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from service.config.errors import TaskInterfaceError
from service.data.batches import checked_collate, to_device
from service.data.dataset_feed import dataset_feed
from service.data.feeds import MapFeed, StreamFeed
from service.data.geometry import batch_geometry, plan_total_steps  # noqa: F401 (plan_total_steps: re-exported)
from service.data.loaders import eval_loader
from service.data.sampler import StepPlan
from service.loop.runtime import Runtime
from service.loop.stepping import Hooks, seed_step, step_seed, steps  # noqa: F401 (step_seed, seed_step: re-exported)
from service.loop.task_step import TaskStep
from service.model.nonfinite import NonfiniteGuard
from service.model.optim import (
    LRSchedule,
    build_optimizer,
    build_schedule,
    describe_defaults,
    make_optimizer,
    schedule_setting,
)
from service.model.parallel import unwrap
from service.model.precision import Precision
from service.model.schedule import lr_lambda
from service.state.weights import init_model
from service.tasks.base import Task
from service.tasks.loader import load_task
from service.telemetry.metrics import EvalReport
from service.telemetry.progress import CHECKPOINT, EVAL, OPTIMIZER, Progress

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TaskJob:
    """What a task's step needs, built once by :func:`build_job` on a runtime."""

    runtime: Runtime
    task: Task
    step: TaskStep
    eval_names: list[str]
    model: nn.Module
    params: list[torch.Tensor]  # the model's, listed once: walking its modules every step costs ~50 µs
    optimizer: torch.optim.Optimizer
    scheduler: LRSchedule
    feed: MapFeed | StreamFeed
    eval_loader: Any
    nonfinite: NonfiniteGuard
    precision: Precision

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def progress(self) -> Progress:
        return self.runtime.progress

    @property
    def roles(self) -> Any:
        return self.runtime.roles

    @property
    def autocast(self) -> Callable[[], contextlib.AbstractContextManager]:
        return self.precision.autocast


def build_job(rt: Runtime) -> TaskJob:
    """Load the task, wrap its model, build its optimizer and schedule, and keep them (restored on a resume)."""
    config, train = rt.config, rt.config.train
    task = load_task(config.task, config.seed, config.task_options)
    rt.startup.mark("task_built")
    step = TaskStep(task, config.task)
    collate = task.collate_fn or checked_collate(config.task)
    _, micro_steps = batch_geometry(train, rt.world.world_size)  # at this world size, decided at every start
    feed = dataset_feed(rt, task.train_set, train.batch_size, collate, tail="fill", micro_steps=micro_steps,
                        call=f"the task {config.task!r}'s train_set")  # fmt: skip
    if rt.resumed is None and config.init_from is not None:  # init_from: a fresh run only, every rank, before DDP
        init_model(task.model, config.init_from.path, config.init_from.strict)
    model = rt.model(task.model, call="the task's model")
    rt.startup.mark("model_wrapped")
    module = unwrap(model)
    total_steps = rt.plan(feed)
    optimizer = build_optimizer(task, config.task, module, lambda: make_optimizer(model.parameters(), train))
    scheduler = build_schedule(
        task,
        config.task,
        optimizer,
        total_steps,
        train,
        lambda: LambdaLR(optimizer, lr_lambda(train, total_steps, schedule_setting(task, train))),
    )
    grad_clip = describe_defaults(task, config.task, train)
    precision = Precision.for_job(train.amp, rt.device)
    rt.keep({"model": module, "optimizer": optimizer, "scheduler": scheduler, "scaler": precision, **task.state},
            call="the task's state")  # fmt: skip
    nonfinite = NonfiniteGuard.for_job(config, rt.device, total_steps, precision, grad_clip)
    rt.nonfinite = nonfinite
    one_sample = lambda dataset: to_device(collate([dataset[0]]), rt.device)  # noqa: E731
    eval_names = step.metric_names(module, lambda: one_sample(task.eval_set), len(task.eval_set), precision.autocast)  # type: ignore[arg-type]
    rt.roles.checkpointer.check_metrics(eval_names)  # checkpoint.best names one of them, on every rank
    rt.startup.mark("task_ready")
    return TaskJob(
        runtime=rt, task=task, step=step, eval_names=eval_names, model=model, params=list(model.parameters()),
        optimizer=optimizer, scheduler=scheduler, feed=feed,
        eval_loader=eval_loader(task.eval_set, train.batch_size, config.data, rt.world, collate),
        nonfinite=nonfinite, precision=precision,
    )  # fmt: skip


def optimizer_step(job: Any, plan: StepPlan, micro_batches: list[Any], step: int) -> Tensor:
    """Forward/backward each micro-batch (gradient sync only on the last), then one optimizer step.

    Each micro-batch's mean loss is scaled by its plan weight, so the gradient
    DDP averages is the mean over every sample of the global step. Returns the
    step's loss (a detached tensor: no host sync here). The wrapped model marks
    the forward and backward of each micro-step on the progress record.
    """
    model, count, loss_of, progress = job.model, len(micro_batches), job.step.loss, job.progress
    loss_sum: Tensor | None = None  # in float32, the first micro-step's loss as it is (no zeros to add it to)
    for index, (batch, part) in enumerate(zip(micro_batches, plan.micro, strict=True)):
        batch = to_device(batch, job.device, non_blocking=True)
        last = index == count - 1
        sync = model.no_sync() if not last and isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
        with sync:
            with job.autocast():
                loss = loss_of(model, batch)
                if part.weight != 1.0:  # 1.0 for every micro-batch of a full step without accumulation
                    loss = loss * part.weight
            job.precision.backward(loss)  # scaled under fp16
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach()
    progress.mark(OPTIMIZER)
    job.roles.snapshots.before_update()  # the snapshot of the last step has copied the weights
    job.nonfinite.step(job.params, job.optimizer, step)  # clips; skips or records a nan step
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return loss_sum if loss_sum is not None else torch.zeros((), device=job.device)


@torch.no_grad()
def evaluate(job: TaskJob) -> EvalReport | None:
    """Each eval value's mean over the whole eval set, summed across ranks; None for an empty eval set.

    Runs the unwrapped model: DDP's forward would broadcast buffers, a collective
    that ranks with different shard lengths would not all join.
    """
    rt, names, started = job.runtime, job.eval_names, time.perf_counter()
    if not names:
        return None
    model, progress = unwrap(job.model), job.progress
    progress.mark(EVAL)
    model.eval()
    totals = torch.zeros(len(names) + 1, device=job.device, dtype=torch.float64)
    for batch in job.eval_loader:
        progress.tick += 1
        sums, count = job.step.eval_values(model, to_device(batch, job.device), job.autocast)
        if list(sums) != names:
            raise TaskInterfaceError(
                f"The eval_fn of task {rt.config.task!r} returned the values {list(sums)} for one batch and "
                f"{names} for the first; it must return the same names for every batch."
            )
        totals[:-1] += torch.stack(list(sums.values()))
        totals[-1] += count
    dist.all_reduce(totals)
    samples = max(totals[-1].item(), 1.0)
    means = {name: value / samples for name, value in zip(names, totals[:-1].tolist(), strict=True)}
    state = rt.state
    report = EvalReport(epoch=state.epoch, global_step=state.global_step, metrics=means,
                        metric_name=job.step.headline(names))  # fmt: skip
    job.scheduler.evaluated(means)
    job.roles.sink.on_eval(report, time.perf_counter() - started)
    return report


class TaskLoop:
    """The task loop's additions at the step boundary: its evaluations and ``checkpoint.best`` of them."""

    def __init__(self, job: TaskJob) -> None:
        self.job = job
        self.evals: list[EvalReport | None] = []
        train = job.runtime.config.train
        self.eval_every, self.every_epoch = train.eval_every, train.eval_every is None

    def hooks(self) -> Hooks:
        return Hooks(stepped=self.job.nonfinite.check, boundary=self.boundary, epoch_start=self.train_mode,
                     epoch_end=self.epoch_end, after_epoch=self.after_epoch)  # fmt: skip

    def train_mode(self) -> None:
        self.job.model.train()

    def boundary(self) -> str | None:
        """``train.eval_every``: evaluate every that many optimizer steps (but the last, which the end evaluates)."""
        rt = self.job.runtime
        step = rt.state.global_step
        if not self.eval_every or step % self.eval_every or step >= rt.total_steps:
            return None
        self.evals.append(evaluate(self.job))
        self.keep_if_best(self.evals[-1])
        self.job.model.train()
        return rt.preemption.stop_here()  # a signal during the evaluation

    def epoch_end(self, final: bool) -> None:
        self._evaluated = self.every_epoch or final
        if self._evaluated:
            self.evals.append(evaluate(self.job))

    def after_epoch(self) -> None:
        if self._evaluated:  # checkpoint.best, once the epoch's end is in the state (a resume starts the next one)
            self.keep_if_best(self.evals[-1])

    def keep_if_best(self, report: EvalReport | None) -> None:
        """``checkpoint.best``: rank 0 keeps this step's checkpoint when its evaluation is the best so far."""
        if report is not None:
            rt = self.job.runtime
            rt.progress.mark(CHECKPOINT)
            rt.gather_own()
            rt.roles.checkpointer.on_eval(rt.state.global_step, report.metrics, rt.checkpoint_state)

    def summary(self) -> dict[str, Any]:
        """The task loop's entries of summary.json: its last evaluation."""
        report = self.evals[-1] if self.evals else None
        step = self.job.step
        return {
            "final_loss": report.loss if report else None,
            "eval_metric": {"name": step.headline(self.job.eval_names), "value": report.metric if report else None},
            "eval_metrics": dict(report.metrics) if report else {},
        }


def train(job: TaskJob) -> dict[str, Any]:
    """Run from where the job stands to ``total_steps``, evaluating after each epoch (or every
    ``train.eval_every`` steps) and at the end; stop early if preempted."""
    rt, loop = job.runtime, TaskLoop(job)
    step = job.step
    try:
        for fed in steps(rt, job.feed, loop.hooks(), call="the task loop's first step"):
            loss = optimizer_step(job, fed.plan, fed.batches, rt.state.global_step + 1)
            rt.log({"loss": loss, **step.take_extras()}, call="the task's step_fn")
            fed.tokens = step.count_tokens(fed.batches, [part.real for part in fed.plan.micro])
        return rt.finish(rt.stopped or "completed", loop.summary())
    except Exception as exc:
        rt.fail(exc, loop.summary())
        raise
    finally:
        job.feed.close()  # its loader workers would hold the process's exit


def run_task(rt: Runtime) -> dict[str, Any]:
    """``ddp-service train``: build the configured task on this start and train it."""
    return train(build_job(rt))


__all__ = [
    "TaskJob",
    "batch_geometry",
    "build_job",
    "evaluate",
    "optimizer_step",
    "plan_total_steps",
    "run_task",
    "seed_step",
    "step_seed",
    "train",
]
