"""A task whose training forward turns nan at chosen calls: drives ``train.nonfinite`` end to end. With
``task_options.raise_on_rank`` R, the worker of ``RANK`` R raises ValueError there instead, and the others go on."""

from __future__ import annotations

import os

from torch import Tensor, nn

from service.tasks.base import Task, TaskSpec
from service.tasks.digits import accuracy, load_digits_split


class NanAt(nn.Module):
    def __init__(self, calls: list[int], raise_on_rank: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.calls, self.nan_at = 0, set(calls)
        self.raise_on_rank = raise_on_rank
        self.raises = raise_on_rank is not None and os.environ.get("RANK") == str(raise_on_rank)

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        if self.training:
            self.calls += 1
            if self.calls in self.nan_at and self.raises:
                raise ValueError(f"rank {os.environ.get('RANK')} alone: bad batch at forward {self.calls}")
            if self.calls in self.nan_at and self.raise_on_rank is None:
                out = out * float("nan")
        return out


def nan_at(spec: TaskSpec) -> Task:
    """Digits with a linear model; ``task_options.steps``: the training forwards (1 = first) that output nan."""
    train_set, eval_set = load_digits_split(spec.seed, 0.2)
    model = NanAt(list(spec.options.get("steps", [3])), spec.options.get("raise_on_rank"))
    return Task(model, train_set, eval_set, nn.CrossEntropyLoss(), accuracy, "accuracy")
