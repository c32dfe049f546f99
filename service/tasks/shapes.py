"""The seed's scenario: segment generated shapes with a small UNet (BatchNorm inside).

Images are drawn from the seed alone, so every rank builds the same dataset
without downloading or sharing anything.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from service.tasks.base import Task, TaskSpec


def make_shapes(count: int, size: int, seed: int) -> TensorDataset:
    """``count`` noisy 1×size×size images of a circle, square or triangle, with 0/1 masks."""
    gen = torch.Generator().manual_seed(seed)
    coords = torch.arange(size, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    kind = torch.randint(0, 3, (count, 1, 1), generator=gen)
    radius = size * (0.12 + 0.18 * torch.rand(count, 1, 1, generator=gen))
    cx = radius + (size - 2 * radius) * torch.rand(count, 1, 1, generator=gen)
    cy = radius + (size - 2 * radius) * torch.rand(count, 1, 1, generator=gen)
    dx, dy = xx - cx, yy - cy
    circle = dx**2 + dy**2 <= radius**2
    square = (dx.abs() <= radius * 0.85) & (dy.abs() <= radius * 0.85)
    triangle = (dy <= radius) & (dy >= -radius) & (dx.abs() <= (dy + radius) / 2)
    mask = torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))
    brightness = 0.5 + 0.5 * torch.rand(count, 1, 1, generator=gen)
    images = mask * brightness + 0.25 * torch.randn(count, size, size, generator=gen)
    return TensorDataset(images.unsqueeze(1).float(), mask.long())


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """A two-level UNet: enough to learn shapes, small enough for CPU tests."""

    def __init__(self, in_channels: int = 1, classes: int = 2, width: int = 8) -> None:
        super().__init__()
        self.enc1 = _block(in_channels, width)
        self.enc2 = _block(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = _block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skip = self.enc1(x)
        deep = self.enc2(self.pool(skip))
        return self.head(self.dec(torch.cat([self.up(deep), skip], dim=1)))


def dice(output: Tensor, target: Tensor, eps: float = 1.0) -> Tensor:
    """Per-sample Dice of the predicted foreground against the mask."""
    pred = output.argmax(dim=1).bool().flatten(1)
    truth = target.bool().flatten(1)
    inter = (pred & truth).sum(1).float()
    return (2 * inter + eps) / (pred.sum(1) + truth.sum(1) + eps).float()


def build(spec: TaskSpec) -> Task:
    size = int(spec.option("image_size", 32))
    train_size = int(spec.option("train_size", 256))
    eval_size = int(spec.option("eval_size", 64))
    torch.manual_seed(spec.seed)
    return Task(
        model=UNet(width=int(spec.option("width", 8))),
        train_set=make_shapes(train_size, size, seed=spec.seed),
        eval_set=make_shapes(eval_size, size, seed=spec.seed + 1_000_003),
        loss_fn=nn.CrossEntropyLoss(),
        metric_fn=dice,
        metric_name="dice",
    )
