"""Classification on real data: scikit-learn's bundled 8×8 handwritten digits (1,797 images).

The data ships inside the scikit-learn wheel, so nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from service.tasks.base import Task, TaskSpec


def load_digits_split(seed: int, eval_fraction: float) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits  # heavy import: only when this task is used

    images, labels = load_digits(return_X_y=True)
    inputs = torch.from_numpy(images).float() / 16.0
    targets = torch.from_numpy(labels).long()
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed))
    cut = int(len(order) * (1 - eval_fraction))
    train, held = order[:cut], order[cut:]
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[held], targets[held])


def mlp(hidden: int, batchnorm: bool) -> nn.Sequential:
    norm = (lambda n: nn.BatchNorm1d(n)) if batchnorm else (lambda n: nn.Identity())
    return nn.Sequential(
        nn.Linear(64, hidden), norm(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), norm(hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip


def accuracy(output: Tensor, target: Tensor) -> Tensor:
    return (output.argmax(dim=1) == target).float()


def build(spec: TaskSpec) -> Task:
    train_set, eval_set = load_digits_split(spec.seed, float(spec.option("eval_fraction", 0.2)))
    torch.manual_seed(spec.seed)
    return Task(
        model=mlp(int(spec.option("hidden", 64)), bool(spec.option("batchnorm", True))),
        train_set=train_set,
        eval_set=eval_set,
        loss_fn=nn.CrossEntropyLoss(),
        metric_fn=accuracy,
        metric_name="accuracy",
    )
