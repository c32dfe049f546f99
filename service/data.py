"""Loaders that give each rank its own shard: DistributedSampler for training, a plain stride for eval."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from service.config import DataConfig
from service.env import WorldInfo


def train_loader(dataset: Dataset, batch_size: int, data: DataConfig, world: WorldInfo,
                 seed: int) -> tuple[DataLoader, DistributedSampler]:  # fmt: skip
    """Shuffled shards; call ``sampler.set_epoch(epoch)`` each epoch or every epoch repeats one order."""
    sampler = DistributedSampler(dataset, num_replicas=world.world_size, rank=world.rank, shuffle=True, seed=seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=data.num_workers,
        pin_memory=data.pin_memory,
        persistent_workers=data.num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler


def eval_loader(dataset: Dataset, batch_size: int, data: DataConfig, world: WorldInfo) -> DataLoader:
    """Every eval sample exactly once across ranks: no padding duplicates, so all-reduced means are exact."""
    shard = range(world.rank, len(dataset), world.world_size)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch_size, sampler=shard, num_workers=data.num_workers,
                      pin_memory=data.pin_memory)  # fmt: skip
