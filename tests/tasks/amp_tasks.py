"""A task whose loss is huge (finite, 1e30 times the real one) on one training sample: drives fp16's scaler.

Under ``train.amp: fp16`` the scaled loss's gradient overflows float16 in backward at the step that trains
that sample, so the gradient scaler skips the step and halves its scale. The sample is the one at
``task_options.position`` of epoch 0's shuffled order (the service's sampler, seed 0): with a global
batch of 16, position 32 is in step 3 (a list of positions marks one sample at each: ``[32, 64]``, steps 3
and 5). Tied to a sample, not to a count of forwards, it recurs after a resume exactly where it would have
without one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from service.data.sampler import permutation
from service.tasks.base import Task, TaskSpec
from service.tasks.digits import accuracy, load_digits_split


class HugeOnMarked(nn.Module):
    """A linear model that notes whether its training batch holds the marked sample (feature 0 below zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.huge_now = False

    def forward(self, x: Tensor) -> Tensor:
        self.huge_now = self.training and bool((x[:, 0] < 0).any())
        return self.linear(x)


def huge_loss_at(spec: TaskSpec) -> Task:
    train_set, eval_set = load_digits_split(spec.seed, 0.2)
    inputs, targets = train_set.tensors
    inputs = inputs.clone()
    positions = spec.option("position", 32)
    order = permutation(len(inputs), spec.seed, 0)
    for position in positions if isinstance(positions, list) else [positions]:
        inputs[order[int(position)], 0] = -1.0  # digits are >= 0
    model = HugeOnMarked()
    cross_entropy = nn.CrossEntropyLoss()

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        loss = cross_entropy(output, target)
        return loss * 1e30 if model.huge_now else loss

    torch.manual_seed(spec.seed)
    return Task(model, TensorDataset(inputs, targets), eval_set, loss_fn, accuracy, "accuracy")
