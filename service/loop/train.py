"""The training loop: build the job once, then epochs → optimizer steps → micro-steps.

Nothing in here asks for its rank: the per-rank behaviour lives in the
:class:`~service.loop.roles.Roles` objects built before the loop starts.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from service.config import JobConfig
from service.loop.batches import checked_collate, to_device
from service.loop.data import eval_loader, train_loader
from service.loop.geometry import batch_geometry, plan_total_steps
from service.loop.job import Job, LoopState, checkpoint_state, make_summary
from service.loop.nonfinite import NonfiniteGuard
from service.loop.optim import build_optimizer, build_schedule, make_optimizer
from service.loop.parallel import settle_buckets, unwrap, wrap_model
from service.loop.precision import Precision
from service.loop.progress import BACKWARD, CHECKPOINT, DATA, EVAL, FORWARD, OPTIMIZER, Progress
from service.loop.roles import build_roles
from service.loop.sampler import DataPlan, StepPlan
from service.loop.schedule import lr_lambda
from service.loop.steps import TaskInterfaceError, TaskStep
from service.loop.syncbn import tick_collectives
from service.loop.watchdog import Watchdog
from service.state.consistency import check_same_config
from service.state.preemption import Preemption
from service.state.resume import (
    agree_on_checkpoint,
    check_compatible,
    config_hash,
    fresh_lineage,
    job_lineage,
    restore,
)
from service.state.snapshot import node_area
from service.state.weights import init_model
from service.tasks.loader import load_task
from service.telemetry.goodput import StartTimes
from service.telemetry.metrics import EvalReport, StepReport
from service.world.distributed import DistContext, any_rank, sum_across
from service.world.env import WorldInfo

log = logging.getLogger(__name__)


def build_job(config: JobConfig, world: WorldInfo, dist_ctx: DistContext, preemption: Preemption | None = None,
              terminal: bool = False) -> Job:  # fmt: skip
    """The job of this start; ``preemption``: the handlers the command installed first thing (else new ones);
    ``terminal``: stderr is a terminal (rank 0 draws a progress bar)."""
    global_batch, micro_steps = batch_geometry(config.train, world.world_size)  # before any work
    check_same_config(config, world.world_size, dist_ctx.control)
    preemption = preemption or Preemption()
    preemption.connect(any_rank(dist_ctx.control))
    torch.manual_seed(config.seed)
    task = load_task(config.task, config.seed, config.task_options)
    step = TaskStep(task, config.task)
    collate = task.collate_fn or checked_collate(config.task)
    train = config.train
    checkpoints = Path(config.run_dir) / "checkpoints"
    own = job_lineage(world.run_id) if config.checkpoint.resume == "never" else None  # never: this job's only
    area = node_area(config.checkpoint.snapshot_dir, config.run_dir, world.run_id)
    agreeing = time.perf_counter()  # the resume's time, for the goodput ledger: the agreement (it loads) and restore
    resumed = agree_on_checkpoint(checkpoints, world.rank, world.world_size, dist_ctx.control,
                                  config.checkpoint.resume, own, area.readable() if area else None)  # fmt: skip
    restore_seconds = time.perf_counter() - agreeing if resumed is not None else 0.0
    # The job's lineage, the same on every rank: every checkpoint and snapshot carries it, whichever rank writes it
    # (a survivor of a lost node writes the next ones; its restarts under resume=never look for this one).
    lineage = own or (resumed.state.get("lineage") if resumed else fresh_lineage(dist_ctx.control))
    digest = config_hash(config)
    if resumed is None and config.init_from is not None:  # init_from: a fresh run only, every rank, before DDP
        init_model(task.model, config.init_from.path, config.init_from.strict)
    model = wrap_model(task.model, train, config.ddp, world, dist_ctx.device)
    if resumed is not None:
        check_compatible(resumed, config)
    state = LoopState(**resumed.state["loop"]) if resumed else LoopState()
    plan = DataPlan(len(task.train_set), config.seed, global_batch, world.world_size, world.rank, micro_steps)  # type: ignore[arg-type]
    total_steps = plan_total_steps(plan, state, train)
    module = unwrap(model)
    optimizer = build_optimizer(task, config.task, module, lambda: make_optimizer(model.parameters(), train))
    scheduler = build_schedule(task, config.task, optimizer, total_steps,
                               lambda: LambdaLR(optimizer, lr_lambda(train, total_steps)))  # fmt: skip
    precision = Precision.for_job(train.amp, dist_ctx.device)
    if resumed is not None:
        restoring = time.perf_counter()
        restore(resumed, module, optimizer, scheduler, world.world_size, global_batch, precision)
        restore_seconds += time.perf_counter() - restoring
    one_sample = lambda dataset: to_device(collate([dataset[0]]), dist_ctx.device)  # noqa: E731
    # Resume stays bit-exact at any world size: DDP's buckets settle before the first real step.
    settle_buckets(model, world.world_size, lambda: one_sample(task.train_set), step.settle_loss, precision.autocast)
    eval_names = step.metric_names(module, lambda: one_sample(task.eval_set), len(task.eval_set), precision.autocast)  # type: ignore[arg-type]
    loader, sampler = train_loader(task.train_set, plan, config.data, config.seed, collate)
    roles = build_roles(
        config,
        world,
        total_steps,
        digest,
        dist_ctx.is_cuda,
        resumed,
        lineage,
        dist_ctx.backend,
        terminal,
        area,
        StartTimes.of(dist_ctx.began, dist_ctx.up, restore_seconds, state.global_step),
    )
    progress = Progress(state.global_step)
    tick_collectives(model, progress.collective)
    job = Job(
        config=config,
        world=world,
        device=dist_ctx.device,
        task=task,
        step=step,
        eval_names=eval_names,
        model=model,
        params=list(model.parameters()),
        optimizer=optimizer,
        scheduler=scheduler,
        plan=plan,
        sampler=sampler,
        loader=loader,
        eval_loader=eval_loader(task.eval_set, train.batch_size, config.data, world, collate),
        roles=roles,
        preemption=preemption,
        nonfinite=NonfiniteGuard.for_job(config, dist_ctx.device, total_steps, precision),
        barrier=lambda: dist.barrier(group=dist_ctx.control),
        state=state,
        resumed=resumed,
        total_steps=total_steps,
        world_sum=sum_across(dist_ctx.control),
        precision=precision,
        config_json=config.model_dump(mode="json"),
        config_digest=digest,
        progress=progress,
        lineage=lineage,
        # os._exit skips the loop's clean-up: on the last attempt the watchdog removes the snapshots itself
        watchdog=Watchdog.for_job(
            config,
            world,
            dist_ctx,
            progress,
            preemption,
            roles.sink,
            roles.snapshots.abandon if last_attempt(world) else lambda: None,
        ),
    )
    job.roles.checkpointer.preflight(unwrap(model))  # rank 0: room for a checkpoint, before any training
    job.roles.snapshots.preflight(unwrap(model))  # each node's local rank 0: room in shared memory, or none kept
    job.roles.checkpointer.check_metrics(eval_names)  # checkpoint.best names one of them, on every rank
    job.roles.sink.instrument(model)  # e.g. a comm hook that times DDP's all-reduce
    return job


def last_attempt(world: WorldInfo) -> bool:
    """No restart of this node's workers will come: what this start leaves in shared memory, nobody reads."""
    return world.restart_count >= world.max_restarts


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one optimizer step on one rank: dropout and augmentation replay exactly on resume."""
    return ((seed * 1_000_003 + step) * 7_919 + rank) % 2**32


def seed_step(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Seed torch (this device's generator too), ``random`` and numpy; about 5 µs, so every step can."""
    value = step_seed(seed, step, rank)
    torch.default_generator.manual_seed(value)  # torch.manual_seed visits every backend: 60 µs
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def optimizer_step(job: Job, plan: StepPlan, micro_batches: list[Any], step: int) -> Tensor:
    """Forward/backward each micro-batch (gradient sync only on the last), then one optimizer step.

    Each micro-batch's mean loss is scaled by its plan weight, so the gradient
    DDP averages is the mean over every sample of the global step. Returns the
    step's loss (a detached tensor: no host sync here).
    """
    model, count, loss_of, progress = job.model, len(micro_batches), job.step.loss, job.progress
    loss_sum = torch.zeros((), device=job.device)
    for index, (batch, part) in enumerate(zip(micro_batches, plan.micro, strict=True)):
        progress.tick += 1
        progress.mark(FORWARD, index)
        batch = to_device(batch, job.device, non_blocking=True)
        last = index == count - 1
        sync = model.no_sync() if not last and isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
        with sync:
            with job.autocast():
                loss = loss_of(model, batch)
                if part.weight != 1.0:  # 1.0 for every micro-batch of a full step without accumulation
                    loss = loss * part.weight
            progress.mark(BACKWARD, index)  # this rank reached its backward and the all-reduce in it
            job.precision.backward(loss)  # scaled under fp16
        loss_sum += loss.detach()
    progress.mark(OPTIMIZER)
    job.roles.snapshots.before_update()  # the snapshot of the last step has copied the weights
    job.nonfinite.step(job.params, job.optimizer, step)  # clips; skips or records a nan step
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return loss_sum


class _Window:
    """Loss and throughput between two log lines; read from the device once per window.

    At each log step (the same steps on every rank) one all-reduce of host
    numbers (``world_sum``, on the control group) adds the world's loss and
    throughput to this rank's own: no device sync besides the window's one read.
    """

    def __init__(self, device: torch.device, world_sum: Callable[[list[float]], list[float]]) -> None:
        self.device = device
        self.world_sum = world_sum
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
        loss_sum, steps, rate = self.loss.item(), max(1, self.steps), self.samples / elapsed
        world_loss_sum, world_steps, world_rate = self.world_sum([loss_sum, steps, rate])
        report = StepReport(
            global_step=state.global_step,
            total_steps=job.total_steps,
            epoch=state.epoch,
            loss=loss_sum / steps,
            lr=job.optimizer.param_groups[0]["lr"],
            samples_seen=state.samples_seen,
            rank_samples_per_second=rate,
            world_loss=world_loss_sum / world_steps,
            world_samples_per_second=world_rate,
            seconds_per_step=elapsed / steps,
        )
        self.reset()
        return report


def train_epoch(job: Job, state: LoopState, window: _Window, evals: list[EvalReport | None]) -> str:
    """Steps from the cursor to the end of the epoch; returns why it stopped.

    With ``train.eval_every``, evaluates every that many optimizer steps (but
    the last, which :func:`train` evaluates), appending to ``evals``.

    ``"epoch"``: the epoch is done; ``"steps"``: ``total_steps`` reached;
    ``"preempted"``: a rank was signalled (the step that just ran is kept);
    ``"lock_lost"``: rank 0 lost the run_dir lock (nothing more is saved).
    """
    if state.global_step >= job.total_steps:
        return "steps"
    progress = job.progress
    progress.mark(DATA)
    job.model.train()
    job.sampler.position(state.epoch, state.cursor)
    batches = iter(job.loader)
    log_every, eval_every, roles, seed = job.config.train.log_every, job.config.train.eval_every, job.roles, \
        job.config.seed  # fmt: skip
    for plan in job.plan.steps(state.epoch, state.cursor):
        started = time.perf_counter()  # host timers only: no device sync for the metrics
        progress.mark(DATA)
        micro = [next(batches) for _ in plan.micro]
        fetched = time.perf_counter()
        seed_step(seed, state.global_step, job.world.rank, job.device)
        loss = optimizer_step(job, plan, micro, state.global_step + 1)
        state.global_step += 1
        progress.stepped(state.global_step, time.perf_counter() - started)
        job.nonfinite.check(state.global_step)
        state.cursor = plan.end
        state.samples_seen += plan.size
        reals = [part.real for part in plan.micro]
        rank_samples = sum(reals)
        window.add(loss, rank_samples)
        tokens = job.step.count_tokens(micro, reals)
        roles.sink.on_step(rank_samples, time.perf_counter() - started, fetched - started, tokens)
        roles.trace.record(plan, state.global_step)
        if state.global_step % log_every == 0:
            roles.sink.on_report(window.report(job, state))
        if stop := job.preemption.stop_now():
            return stop
        if eval_every and state.global_step % eval_every == 0 and state.global_step < job.total_steps:
            evals.append(evaluate(job, state))
            keep_if_best(job, state, evals[-1])  # checkpoint.best
            job.model.train()
            if stop := job.preemption.stop_here():  # a signal during the evaluation
                return stop
        progress.mark(CHECKPOINT)
        saving = time.perf_counter()
        roles.checkpointer.maybe_save(state.global_step, lambda: checkpoint_state(job, state))
        roles.snapshots.capture(state.global_step, lambda: checkpoint_state(job, state, checked=False))
        roles.sink.on_checkpoint_stall(time.perf_counter() - saving)
        if state.global_step >= job.total_steps:
            return "epoch" if state.cursor >= job.plan.length else "steps"
    return "epoch"


@torch.no_grad()
def evaluate(job: Job, state: LoopState) -> EvalReport | None:
    """Each eval value's mean over the whole eval set, summed across ranks; None for an empty eval set.

    Runs the unwrapped model: DDP's forward would broadcast buffers, a collective
    that ranks with different shard lengths would not all join.
    """
    names, started = job.eval_names, time.perf_counter()
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
                f"The eval_fn of task {job.config.task!r} returned the values {list(sums)} for one batch and "
                f"{names} for the first; it must return the same names for every batch."
            )
        totals[:-1] += torch.stack(list(sums.values()))
        totals[-1] += count
    dist.all_reduce(totals)
    samples = max(totals[-1].item(), 1.0)
    means = {name: value / samples for name, value in zip(names, totals[:-1].tolist(), strict=True)}
    report = EvalReport(epoch=state.epoch, global_step=state.global_step, metrics=means,
                        metric_name=job.step.headline(names))  # fmt: skip
    job.scheduler.evaluated(means)
    job.roles.sink.on_eval(report, time.perf_counter() - started)
    return report


def keep_if_best(job: Job, state: LoopState, report: EvalReport | None) -> None:
    """``checkpoint.best``: rank 0 keeps this step's checkpoint when its evaluation is the best so far."""
    if report is not None:
        job.progress.mark(CHECKPOINT)
        job.roles.checkpointer.on_eval(state.global_step, report.metrics, lambda: checkpoint_state(job, state))


def train(job: Job) -> dict[str, Any]:
    """Run from where the job stands to ``total_steps``, evaluating after each epoch (or every
    ``train.eval_every`` steps) and at the end; stop early if preempted."""
    started = time.perf_counter()
    state, window, status = job.state, _Window(job.device, job.world_sum), "completed"
    evals: list[EvalReport | None] = []
    every_epoch = job.config.train.eval_every is None
    start_samples = state.samples_seen
    job.watchdog.start()
    try:
        while True:
            if stop := job.preemption.stop_here():  # a signal in start-up, the last evaluation or checkpoint
                status = stop
                break
            outcome = train_epoch(job, state, window, evals)
            if outcome in ("preempted", "lock_lost"):
                status = outcome
                break
            if outcome == "epoch":
                state.epochs_completed += 1
            evaluated = every_epoch or state.global_step >= job.total_steps
            if evaluated:
                evals.append(evaluate(job, state))
            if outcome == "epoch":
                state.epoch, state.cursor = state.epoch + 1, 0
            if evaluated:  # checkpoint.best, once the epoch's end is in the state (a resume starts the next one)
                keep_if_best(job, state, evals[-1])
            if state.global_step >= job.total_steps:
                break
        job.progress.mark(CHECKPOINT)
        saving = time.perf_counter()
        job.roles.checkpointer.save(state.global_step, lambda: checkpoint_state(job, state))
        job.roles.sink.on_checkpoint_stall(time.perf_counter() - saving)
        if status == "preempted":
            job.barrier()  # nobody leaves before rank 0's checkpoint of this step is on disk
        job.roles.snapshots.discard()  # completed, or its checkpoint is saved, or run_dir is another job's now
    except Exception as exc:
        if last_attempt(job.world):  # no restart of this node will come for them
            job.roles.snapshots.discard()
        seconds, trained = time.perf_counter() - started, state.samples_seen - start_samples
        report = evals[-1] if evals else None
        failed = make_summary(job, state, report, seconds, trained, "failed", error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped training
            job.roles.summary.write(failed)
        raise
    finally:
        job.watchdog.stop()
    seconds, trained = time.perf_counter() - started, state.samples_seen - start_samples
    last = evals[-1] if evals else None
    summary = make_summary(job, state, last, seconds, trained, status, error=job.preemption.lock_lost)
    job.roles.summary.write(summary)
    return summary
