"""The optimizer and the LR schedule: the task's own (``optimizer_fn``, ``scheduler_fn``) or the config's.

Whatever builds them, the loop steps the schedule once per optimizer step,
and both ``state_dict``s go into every checkpoint, so any torch optimizer,
parameter groups and schedule resume exactly. ``ReduceLROnPlateau`` needs a
value to step on: it steps after each evaluation, on the eval ``loss``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from service.config import TrainConfig
from service.config.errors import TaskInterfaceError
from service.tasks.base import Task

log = logging.getLogger("service.loop.train")


def make_optimizer(params: Iterable[Tensor], train: TrainConfig) -> torch.optim.Optimizer:
    """The config's optimizer (``train.optimizer``), for a task without ``optimizer_fn``."""
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)


def build_optimizer(task: Task, name: str, module: nn.Module,
                    default: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:  # fmt: skip
    """``task.optimizer_fn(module)``, checked to train this module's parameters; else ``default()``."""
    if task.optimizer_fn is None:
        return default()
    optimizer = task.optimizer_fn(module)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskInterfaceError(
            f"The optimizer_fn of task {name!r} returned {type(optimizer).__name__}, not a torch.optim.Optimizer. "
            "Return the optimizer itself, e.g. torch.optim.AdamW(module.parameters(), lr=3e-4)."
        )
    own = {id(parameter) for parameter in module.parameters()}
    held = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    foreign = sum(1 for parameter in held if id(parameter) not in own)
    if foreign or not held:
        raise TaskInterfaceError(
            f"The optimizer_fn of task {name!r} returned an optimizer over {len(held)} tensors, {foreign} of which "
            "are not parameters of the module it was given, so its steps would not train this model. Build it "
            "from the module optimizer_fn receives (module.parameters(), or module.configure_optimizers(...)), "
            "not from a copy made before."
        )
    return optimizer


class LRSchedule:
    """Steps a schedule once per optimizer step, or a plateau schedule after each evaluation."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.on_plateau = isinstance(scheduler, ReduceLROnPlateau)
        self.step: Callable[[], Any] = (lambda: None) if self.on_plateau else scheduler.step

    def evaluated(self, metrics: Mapping[str, float]) -> None:
        if self.on_plateau:
            self.scheduler.step(metrics["loss"])

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def schedule_setting(task: Task, train: TrainConfig) -> str:
    """What ``train.lr_schedule`` means for this task: ``auto`` is cosine over the service's own optimizer, and no
    schedule (``constant``) over a task's own (``optimizer_fn``): a faithful port keeps its learning rate."""
    if train.lr_schedule != "auto":
        return train.lr_schedule
    return "constant" if task.optimizer_fn is not None else "cosine"


def clip_setting(task: Task, train: TrainConfig) -> float | None:
    """What ``train.grad_clip`` means for this task: ``auto`` is 1.0 with the service's optimizer, no clipping with
    a task's own."""
    if train.grad_clip != "auto":
        return train.grad_clip
    return None if task.optimizer_fn is not None else 1.0


def describe_defaults(task: Task, name: str, train: TrainConfig) -> float | None:
    """Log, at start, the schedule and the clipping the service will apply and the keys that change them; return
    the clipping (a max norm, or None)."""
    clip = clip_setting(task, train)
    if task.scheduler_fn is not None:
        schedule = "the task's scheduler_fn"
    else:
        schedule = f"{schedule_setting(task, train)} (train.lr_schedule={train.lr_schedule})"
    owner = "the task's optimizer_fn" if task.optimizer_fn is not None else f"the service's {train.optimizer}"
    log.info("task %s: optimizer %s; LR schedule %s; gradient clipping %s (train.grad_clip=%s). Set "
             "train.lr_schedule and train.grad_clip to change them.", name, owner, schedule,
             f"at norm {clip:g}" if clip is not None else "off", train.grad_clip)  # fmt: skip
    return clip


def build_schedule(task: Task, name: str, optimizer: torch.optim.Optimizer, total_steps: int,
                   train: TrainConfig, default: Callable[[], Any]) -> LRSchedule:  # fmt: skip
    """``task.scheduler_fn(optimizer, total_steps)``, checked; else ``default()``: the config's schedule, which
    :func:`schedule_setting` resolves (no schedule over a task's own optimizer unless the config asks)."""
    if task.scheduler_fn is None:
        return LRSchedule(default())
    scheduler = task.scheduler_fn(optimizer, total_steps)
    if not all(callable(getattr(scheduler, method, None)) for method in ("step", "state_dict", "load_state_dict")):
        raise TaskInterfaceError(
            f"The scheduler_fn of task {name!r} returned {type(scheduler).__name__}, which has no step/state_dict/"
            "load_state_dict. Return a torch.optim.lr_scheduler object built on the optimizer it receives, e.g. "
            "StepLR(optimizer, step_size=100, gamma=0.7)."
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise TaskInterfaceError(
            f"The scheduler_fn of task {name!r} returned a schedule of another optimizer than the one it was "
            "given, so the learning rate of training would never change. Build it on the optimizer argument."
        )
    return LRSchedule(scheduler)
