"""A plain MLP regression task for bench/snapshot.py: ``task_options.layers`` x Linear(width, width), fp32.

The default (6 x 2048) holds 25.2 M parameters, 101 MB of fp32 weights; with
``train.optimizer=adamw`` the resume state is about three times that. The data
are fixed random pairs (``task_options.train_size`` of them), so a step costs
the same every time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from service.tasks.base import Task, TaskSpec


def mlp(spec: TaskSpec) -> Task:
    """``layers`` x (Linear(width, width) + ReLU) on random inputs, mean squared error to random targets."""
    width, layers = int(spec.option("width", 2048)), int(spec.option("layers", 6))
    size = int(spec.option("train_size", 4096))
    generator = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    inputs = torch.randn(size, width, generator=generator)
    targets = torch.randn(size, width, generator=generator)
    data = TensorDataset(inputs, targets)
    return Task(model=nn.Sequential(*blocks[:-1]), train_set=data, eval_set=TensorDataset(inputs[:64], targets[:64]),
                loss_fn=nn.functional.mse_loss)  # fmt: skip
