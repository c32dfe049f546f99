"""Tasks that exist to break: each reproduces an error the service must explain."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from service.tasks.base import Task, TaskSpec
from service.tasks.digits import accuracy, load_digits_split


class InplaceActivation(nn.Module):
    """Scales a sigmoid's output in place, though sigmoid's backward needs that output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.sigmoid(self.linear(x))
        out.mul_(2.0)
        return out


def inplace_activation(spec: TaskSpec) -> Task:
    train_set, eval_set = load_digits_split(spec.seed, 0.2)
    return Task(InplaceActivation(), train_set, eval_set, nn.CrossEntropyLoss(), accuracy, "accuracy")


def not_a_task(spec: TaskSpec) -> dict:
    return {"model": None}


class UnusedHead(nn.Module):
    """Two heads, one of which the forward never calls: its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.unused = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def unused_parameters(spec: TaskSpec) -> Task:
    train_set, eval_set = load_digits_split(spec.seed, 0.2)
    return Task(UnusedHead(), train_set, eval_set, nn.CrossEntropyLoss(), accuracy, "accuracy")
