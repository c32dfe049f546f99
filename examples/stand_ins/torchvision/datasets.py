"""``FakeData``: random images, each drawn from its own index (so every rank and every rerun sees the same ones)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FakeData(torch.utils.data.Dataset):
    def __init__(self, size: int = 1000, image_size: tuple[int, int, int] = (3, 224, 224), num_classes: int = 10,
                 transform: Callable[[Any], Any] | None = None, random_offset: int = 0) -> None:  # fmt: skip
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.transform, self.random_offset = transform, random_offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"{index} is out of range for FakeData of size {self.size}")
        generator = torch.Generator().manual_seed(index + self.random_offset)
        image = torch.rand(self.image_size, generator=generator)
        target = int(torch.randint(0, self.num_classes, (1,), generator=generator))
        return (self.transform(image) if self.transform is not None else image), target
