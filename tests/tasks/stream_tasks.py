"""A task whose training data is a stream: a torch ``IterableDataset`` with a position of its own (``state_dict``),
which the service shards over ranks and loader workers and resumes exactly."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset

from service.tasks.base import Task, TaskSpec


class Numbers(IterableDataset):
    """``(x, y)`` pairs drawn from their own index, endlessly; ``state_dict`` says how far its iterator went."""

    def __init__(self, seed: int) -> None:
        self.seed, self.position = seed, 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
            self.position += 1
            x = torch.randn(4, generator=generator)
            yield x, x.sum(0, keepdim=True) * 0.5

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def numbers(spec: TaskSpec) -> Task:
    torch.manual_seed(spec.seed)
    eval_set = [(torch.randn(4), torch.zeros(1)) for _ in range(8)]
    return Task(model=nn.Linear(4, 1), train_set=Numbers(spec.seed), eval_set=eval_set, loss_fn=nn.functional.mse_loss)
