"""The transforms DCGAN's datasets name; ``FakeData`` images are tensors already, so ``ToTensor`` keeps them."""

from __future__ import annotations

from typing import Any


class ToTensor:
    def __call__(self, image: Any) -> Any:
        return image


class Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class Normalize:
    def __init__(self, mean: Any, std: Any) -> None:
        self.mean, self.std = mean, std

    def __call__(self, image: Any) -> Any:
        import torch

        mean = torch.tensor(self.mean).view(-1, 1, 1)
        std = torch.tensor(self.std).view(-1, 1, 1)
        return (image - mean) / std


class Resize:
    def __init__(self, size: Any) -> None:
        self.size = size

    def __call__(self, image: Any) -> Any:
        return image


CenterCrop = Resize
