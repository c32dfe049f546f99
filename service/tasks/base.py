"""What a task hands the service: a model, two datasets, a loss and an eval metric.

A task knows nothing of processes, ranks or devices: no ``torch.distributed``
here. The service shards the data, wraps the model and moves tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn
from torch.utils.data import Dataset


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the job config passes to a task's build function."""

    seed: int
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def option(self, name: str, default: Any) -> Any:
        return self.options.get(name, default)


@dataclasses.dataclass(frozen=True)
class Task:
    """A built task. Datasets yield ``(input, target)`` pairs.

    ``loss_fn(output, target)`` returns the mean loss over the batch;
    ``metric_fn(output, target)`` returns one score per sample (higher is better),
    which the service averages over the whole eval set across ranks.
    ``tokens_fn(inputs)``, when set, counts the tokens of a batch of real samples
    (on the host, from the loader's CPU tensors) for ``ddp_train_tokens_total``.
    """

    model: nn.Module
    train_set: Dataset
    eval_set: Dataset
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    metric_fn: Callable[[Tensor, Tensor], Tensor]
    metric_name: str
    tokens_fn: Callable[[Tensor], int] | None = None
