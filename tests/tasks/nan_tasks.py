"""A task whose training forward turns nan at chosen calls: drives ``train.nonfinite`` end to end."""

from __future__ import annotations

from torch import Tensor, nn

from service.tasks.base import Task, TaskSpec
from service.tasks.digits import accuracy, load_digits_split


class NanAt(nn.Module):
    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.calls, self.nan_at = 0, set(calls)

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        if self.training:
            self.calls += 1
            if self.calls in self.nan_at:
                out = out * float("nan")
        return out


def nan_at(spec: TaskSpec) -> Task:
    """Digits with a linear model; ``task_options.steps``: the training forwards (1 = first) that output nan."""
    train_set, eval_set = load_digits_split(spec.seed, 0.2)
    model = NanAt(list(spec.options.get("steps", [3])))
    return Task(model, train_set, eval_set, nn.CrossEntropyLoss(), accuracy, "accuracy")
