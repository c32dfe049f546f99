"""Bring your own model: a task is one function that returns a ``service.tasks.base.Task``.

Run it with the folder that holds this file on PYTHONPATH:

    PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 -m service train examples/byo.yaml

No torch.distributed in here: the service shards the data, wraps the model
(DDP, SyncBatchNorm) and moves tensors to the device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from service.tasks.base import Task, TaskSpec


def spirals(count: int, seed: int) -> TensorDataset:
    """Two interleaved spirals, a classic non-linear toy problem."""
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (count,), generator=gen)
    t = torch.rand(count, generator=gen) * 3 * math.pi
    angle = t + label * math.pi
    points = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
    return TensorDataset(points + 0.02 * torch.randn(count, 2, generator=gen), label)


def accuracy(output: Tensor, target: Tensor) -> Tensor:
    return (output.argmax(dim=1) == target).float()


def build(spec: TaskSpec) -> Task:
    hidden = int(spec.option("hidden", 32))
    torch.manual_seed(spec.seed)
    model = nn.Sequential(nn.Linear(2, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Linear(hidden, 2))
    return Task(
        model=model,
        train_set=spirals(int(spec.option("train_size", 512)), spec.seed),
        eval_set=spirals(int(spec.option("eval_size", 128)), spec.seed + 1),
        loss_fn=nn.CrossEntropyLoss(),
        metric_fn=accuracy,
        metric_name="accuracy",
    )
