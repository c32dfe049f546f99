"""How a job's steps are cut at each (re)start: the global batch and micro-steps at this world size, and how many
optimizer steps the whole run has."""

from __future__ import annotations

import logging
from typing import Any

from service.config import TrainConfig
from service.state.loop_state import LoopState

log = logging.getLogger("service.loop.train")


def batch_geometry(train: TrainConfig, world_size: int) -> tuple[int, int]:
    """(samples per optimizer step over the world, micro-steps per rank), decided at every (re)start."""
    if train.global_batch_size is None:
        return train.batch_size * world_size * train.grad_accum, train.grad_accum
    per_micro_step = world_size * train.batch_size
    if train.global_batch_size % per_micro_step:
        raise ValueError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of world_size {world_size} x "
            f"train.batch_size {train.batch_size} = {per_micro_step}, so no whole number of micro-steps makes "
            "that global batch. Pick a global batch that is a multiple of it, or a batch_size that divides "
            f"global_batch_size / world_size for every world size this job may run at."
        )
    return train.global_batch_size, train.global_batch_size // per_micro_step


def plan_total_steps(plan: Any, state: LoopState, train: TrainConfig) -> int:
    """Optimizer steps of the whole run: those done, the rest of this epoch, and the epochs after it.

    ``plan``: a :class:`DataPlan` or a feed (:mod:`service.data.feeds`); a stream without a length has no steps
    per epoch, so ``train.max_steps`` is the whole run then (the feed refuses a stream without it).
    """
    if plan.steps_in_epoch(0) is None:
        return int(train.max_steps or state.global_step)
    remaining = 0
    if state.epoch < train.epochs:
        remaining = plan.steps_in_epoch(state.cursor) + (train.epochs - state.epoch - 1) * plan.steps_in_epoch(0)
    total = state.global_step + remaining
    if train.max_steps and train.max_steps > total:
        log.warning("train.max_steps=%d, but train.epochs=%d allow only %d optimizer steps (%d a full epoch at "
                    "this global batch of %d): training stops at step %d. Raise train.epochs to reach "
                    "train.max_steps.", train.max_steps, train.epochs, total, plan.steps_in_epoch(0),
                    plan.global_batch, total)  # fmt: skip
    return min(total, train.max_steps) if train.max_steps else total
