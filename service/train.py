"""The training loop: build the job once, then epochs → optimizer steps → micro-steps.

Nothing in here asks for its rank: the per-rank behaviour lives in the
:class:`~service.roles.Roles` objects built before the loop starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler

from service.config import JobConfig, TrainConfig
from service.data import eval_loader, train_loader
from service.distributed import DistContext
from service.env import WorldInfo
from service.errors import backward
from service.metrics import EvalReport, StepReport
from service.parallel import unwrap, wrap_model
from service.roles import Roles, build_roles
from service.summary import model_digest
from service.tasks.base import Task
from service.tasks.loader import load_task


@dataclasses.dataclass
class LoopState:
    """Where training stands; what a checkpoint must hold to resume."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    epochs_completed: int = 0


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything the loop needs, built once by :func:`build_job`."""

    config: JobConfig
    world: WorldInfo
    device: torch.device
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: DataLoader
    sampler: DistributedSampler
    eval_loader: DataLoader
    roles: Roles
    steps_per_epoch: int
    total_steps: int
    autocast: Callable[[], contextlib.AbstractContextManager]


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Linear warm-up, then constant or cosine decay to zero at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params: Iterable[Tensor], train: TrainConfig) -> torch.optim.Optimizer:
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)


def autocast_factory(setting: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast on CUDA under ``auto``; off on CPU unless asked for."""
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def plan_steps(batches_per_epoch: int, train: TrainConfig) -> tuple[int, int]:
    """Optimizer steps per epoch (a short last group still steps) and in the whole run."""
    per_epoch = math.ceil(batches_per_epoch / train.grad_accum)
    total = per_epoch * train.epochs
    return per_epoch, min(total, train.max_steps) if train.max_steps else total


def build_job(config: JobConfig, world: WorldInfo, dist_ctx: DistContext) -> Job:
    torch.manual_seed(config.seed)
    task = load_task(config.task, config.seed, config.task_options)
    train = config.train
    model = wrap_model(task.model, train, config.ddp, world, dist_ctx.device)
    loader, sampler = train_loader(task.train_set, train.batch_size, config.data, world, config.seed)
    steps_per_epoch, total_steps = plan_steps(len(loader), train)
    if steps_per_epoch == 0:
        raise ValueError(
            f"The training set of task {config.task!r} is empty for rank {world.rank}; check task_options."
        )
    optimizer = make_optimizer(model.parameters(), train)
    scheduler = LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, train.warmup_steps, train.lr_schedule)
    )
    return Job(
        config=config,
        world=world,
        device=dist_ctx.device,
        task=task,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        sampler=sampler,
        eval_loader=eval_loader(task.eval_set, train.batch_size, config.data, world),
        roles=build_roles(config, world, total_steps),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        autocast=autocast_factory(train.amp, dist_ctx.device),
    )


def _groups(batches: Iterable[Any], size: int) -> Iterator[list[Any]]:
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def optimizer_step(job: Job, micro_batches: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, int]:
    """Forward/backward each micro-batch (gradient sync only on the last), then one optimizer step.

    Returns the step's mean loss (a detached tensor: no host sync here) and the samples used.
    """
    model, count, samples = job.model, len(micro_batches), 0
    loss_sum = torch.zeros((), device=job.device)
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs = inputs.to(job.device, non_blocking=True)
        targets = targets.to(job.device, non_blocking=True)
        last = index == count - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with job.autocast():
                loss = job.task.loss_fn(model(inputs), targets) / count
            backward(loss)
        loss_sum += loss.detach()
        samples += len(inputs)
    if job.config.train.grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), job.config.train.grad_clip)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return loss_sum, samples


class _Window:
    """Loss and throughput between two log lines; read from the device once per window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.steps = 0
        self.samples = 0
        self.started = time.perf_counter()

    def add(self, loss: Tensor, samples: int) -> None:
        self.loss += loss
        self.steps += 1
        self.samples += samples

    def report(self, job: Job, state: LoopState) -> StepReport:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        report = StepReport(
            global_step=state.global_step,
            total_steps=job.total_steps,
            epoch=state.epoch,
            loss=self.loss.item() / max(1, self.steps),
            lr=job.optimizer.param_groups[0]["lr"],
            samples_seen=state.samples_seen,
            rank_samples_per_second=self.samples / elapsed,
        )
        self.reset()
        return report


def train_epoch(job: Job, state: LoopState, window: _Window) -> bool:
    """One pass over this rank's shard, or up to ``total_steps``; True when the pass completed."""
    job.model.train()
    job.sampler.set_epoch(state.epoch)
    log_every = job.config.train.log_every
    for group in _groups(job.loader, job.config.train.grad_accum):
        loss, samples = optimizer_step(job, group)
        state.global_step += 1
        state.samples_seen += samples * job.world.world_size
        window.add(loss, samples)
        job.roles.sink.on_step(samples)
        if state.global_step % log_every == 0:
            job.roles.sink.on_report(window.report(job, state))
        job.roles.checkpointer.maybe_save(state.global_step, lambda: checkpoint_state(job, state))
        if state.global_step >= job.total_steps:
            return state.global_step % job.steps_per_epoch == 0
    return True


@torch.no_grad()
def evaluate(job: Job, state: LoopState) -> EvalReport:
    """Mean loss and metric over the whole eval set, summed across ranks.

    Runs the unwrapped model: DDP's forward would broadcast buffers, a collective
    that ranks with different shard lengths would not all join.
    """
    model = unwrap(job.model)
    model.eval()
    totals = torch.zeros(3, device=job.device, dtype=torch.float64)
    for inputs, targets in job.eval_loader:
        inputs, targets = inputs.to(job.device), targets.to(job.device)
        with job.autocast():
            outputs = model(inputs)
        outputs = outputs.float()
        totals[0] += job.task.loss_fn(outputs, targets).double() * len(inputs)
        totals[1] += job.task.metric_fn(outputs, targets).double().sum()
        totals[2] += len(inputs)
    dist.all_reduce(totals)
    count = max(totals[2].item(), 1.0)
    report = EvalReport(
        epoch=state.epoch,
        global_step=state.global_step,
        loss=totals[0].item() / count,
        metric_name=job.task.metric_name,
        metric=totals[1].item() / count,
    )
    job.roles.sink.on_eval(report)
    return report


def checkpoint_state(job: Job, state: LoopState) -> dict[str, Any]:
    return {
        "model": unwrap(job.model).state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "loop": dataclasses.asdict(state),
        "world_size": job.world.world_size,
        "config": job.config.model_dump(mode="json"),
    }


def train(job: Job) -> dict[str, Any]:
    """Run every epoch, evaluate after each, save the last checkpoint and the summary."""
    started = time.perf_counter()
    state, window = LoopState(), _Window(job.device)
    report = None
    while state.global_step < job.total_steps:
        if train_epoch(job, state, window):
            state.epochs_completed += 1
        report = evaluate(job, state)
        state.epoch += 1
    job.roles.checkpointer.save(state.global_step, lambda: checkpoint_state(job, state))
    seconds = time.perf_counter() - started
    summary = make_summary(job, state, report, seconds)
    job.roles.summary.write(summary)
    return summary


def make_summary(job: Job, state: LoopState, report: EvalReport | None, seconds: float) -> dict[str, Any]:
    return {
        "task": job.config.task,
        "model_digest": model_digest(unwrap(job.model).state_dict()),
        "global_step": state.global_step,
        "samples_seen": state.samples_seen,
        "epochs_completed": state.epochs_completed,
        "world_size": job.world.world_size,
        "restarts": job.world.restart_count,
        "final_loss": report.loss if report else None,
        "eval_metric": {"name": job.task.metric_name, "value": report.metric if report else None},
        "wall_seconds": round(seconds, 3),
        "samples_per_second": round(state.samples_seen / seconds, 2) if seconds > 0 else None,
        "launcher": job.world.launcher,
        "device": job.device.type,
    }
