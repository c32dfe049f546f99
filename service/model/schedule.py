"""``train.lr_schedule``: the learning-rate factor of each optimizer step, a pure function of the step."""

from __future__ import annotations

import math
from collections.abc import Callable

from service.config import TrainConfig


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, floor: float = 0.0) -> float:
    """The factor on ``train.lr`` at ``step`` (0-based): linear warm-up, then constant, linear or cosine decay.

    The decay runs from 1 at ``warmup_steps`` down to ``floor`` (``min_lr / lr``) at ``total_steps``
    and stays there; the warm-up ramps from ``1 / warmup_steps`` to 1 whatever the floor.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def lr_lambda(train: TrainConfig, total_steps: int, schedule: str | None = None) -> Callable[[int], float]:
    """The job's schedule for ``LambdaLR``: fixed by the config and the run's total steps. ``schedule``: what
    ``train.lr_schedule`` resolved to (``auto``: cosine)."""
    floor = train.min_lr / train.lr
    shape = schedule or (train.lr_schedule if train.lr_schedule != "auto" else "cosine")
    return lambda step: lr_factor(step, total_steps, train.warmup_steps, shape, floor)
