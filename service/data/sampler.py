"""The data position: one permutation per epoch, a cursor into it, and the rest striped over the current world.

The cursor is the number of samples of this epoch's permutation that optimizer
steps have consumed; it is the whole data position, and it does not depend on
the world size. Every optimizer step takes the next ``global_batch`` samples of
the permutation (fewer at the end of the epoch) and stripes them over the ranks
of the world that runs it, so a resume at any world size, and any number of
resizes within one epoch, still feeds every sample exactly once.

No ``torch.distributed`` here: a plan is a pure function of its inputs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """This epoch's order of the whole training set, the same on every rank and at every world size; without
    ``shuffle``, the dataset's own order."""
    if not shuffle:
        return torch.arange(length)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)  # seed 1 epoch 0 != seed 0 epoch 1
    return torch.randperm(length, generator=generator)


def permutation(length: int, seed: int, epoch: int) -> list[int]:
    return epoch_order(length, seed, epoch).tolist()


# What a step does with the end of an epoch too short for a whole global batch:
# "fill": a last, smaller step, every rank in it (one without a sample runs a filler of weight 0: the task
#   loop weights each micro-batch's loss); "drop": no last step (a session's drop_last=True); "keep": a last step
#   when every rank gets at least one sample of it, else none (a session's drop_last=False: a script cannot
#   weight a filler away, so none is ever handed out).
TAILS = ("fill", "drop", "keep")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """What one rank feeds in one micro-step.

    ``weight`` scales the batch's mean loss so that DDP's average over the
    ranks is the mean over every sample of the global step, even when the
    last step of an epoch splits unevenly. A rank left without samples in a
    micro-step still runs one (it must join the collectives) on a filler
    sample with weight 0: ``real`` is then 0 and it is never counted.
    """

    indices: tuple[int, ...]
    weight: float
    real: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One optimizer step as this rank sees it."""

    epoch: int
    start: int  # the cursor before the step
    size: int  # samples the whole world consumes in this step
    micro: tuple[MicroBatch, ...]

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def indices(self) -> list[int]:
        """This rank's real samples in the step (no fillers)."""
        return [index for batch in self.micro if batch.real for index in batch.indices]


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``parts`` contiguous chunks whose sizes differ by at most one, the larger first."""
    base, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        chunks.append(items[start : start + size])
        start += size
    return chunks


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """How one world walks an epoch: ``global_batch`` samples per step, ``micro_steps`` per rank per step."""

    length: int
    seed: int
    global_batch: int
    world_size: int
    rank: int
    micro_steps: int
    shuffle: bool = True
    tail: str = "fill"

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError("The training set is empty; check the task and its task_options.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.global_batch < 1 or self.micro_steps < 1:
            raise ValueError("global_batch and micro_steps must be at least 1")

    @property
    def end(self) -> int:
        """Where an epoch's steps end: its length, or before a last step ``tail`` leaves out."""
        remainder = self.length % self.global_batch
        if not remainder or self.tail == "fill" or (self.tail == "keep" and remainder >= self.world_size):
            return self.length
        return self.length - remainder

    def steps_in_epoch(self, cursor: int = 0) -> int:
        """Optimizer steps left in an epoch whose cursor stands at ``cursor``."""
        return math.ceil(max(0, self.end - cursor) / self.global_batch)

    def step(self, order: torch.Tensor | Blocks, epoch: int, start: int) -> StepPlan:
        stop = start + self.global_batch
        chunk = order.take(start, stop) if isinstance(order, Blocks) else order[start:stop].tolist()
        size = len(chunk)
        share = chunk[self.rank :: self.world_size]
        micro = []
        for part in _split(share, self.micro_steps):
            if part:
                micro.append(MicroBatch(tuple(part), len(part) * self.world_size / size, len(part)))
            else:
                micro.append(MicroBatch((chunk[0],), 0.0, 0))
        return StepPlan(epoch=epoch, start=start, size=size, micro=tuple(micro))

    def steps(self, epoch: int, cursor: int) -> Iterator[StepPlan]:
        """This rank's steps from ``cursor`` to the end of ``epoch``."""
        if not 0 <= cursor <= self.length:
            raise ValueError(f"cursor {cursor} is outside an epoch of {self.length} samples")
        order = Blocks(epoch_order(self.length, self.seed, epoch, self.shuffle))  # a tensor: 8 bytes a sample
        for start in range(cursor, self.end, self.global_batch):
            yield self.step(order, epoch, start)


class Blocks:
    """An epoch's order read into Python ints a block at a time: each step slices a list, not the tensor (slicing a
    tensor and reading the slice back cost 4 µs a step); memory stays the tensor's and one block's."""

    BLOCK = 4096  # samples read at once

    def __init__(self, order: torch.Tensor) -> None:
        self.order, self.first = order, 0
        self.items: list[int] = []

    def take(self, start: int, stop: int) -> list[int]:
        """``order[start:stop]`` as a list."""
        first = self.first
        if not (first <= start and stop <= first + len(self.items)):
            self.first = first = start
            self.items = self.order[start : max(stop, start + self.BLOCK)].tolist()
        return self.items[start - first : stop - first]


class PlanSampler(Sampler[list[int]]):
    """A DataLoader ``batch_sampler`` over a :class:`DataPlan`: one index list per micro-step.

    Call :meth:`position` before each pass; the loader reads ahead freely,
    because the position that counts is the one the loop records at each
    optimizer step, not what the loader has fetched. Each step's plan goes to
    :attr:`plans` as its first micro-batch's indices are handed out, so the
    loop takes the plan of the batches it has fetched from there, in order,
    instead of planning every step twice.
    """

    def __init__(self, plan: DataPlan) -> None:
        self.plan = plan
        self.epoch = 0
        self.cursor = 0
        self.plans: collections.deque[StepPlan] = collections.deque()

    def position(self, epoch: int, cursor: int) -> None:
        self.epoch, self.cursor = epoch, cursor
        self.plans.clear()

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.plan.steps(self.epoch, self.cursor):
            self.plans.append(step)
            for batch in step.micro:
                yield list(batch.indices)

    def __len__(self) -> int:
        return self.plan.steps_in_epoch(self.cursor) * self.plan.micro_steps
