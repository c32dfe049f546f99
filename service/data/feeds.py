"""What feeds a loop's steps: one optimizer step's batches at a time, and where the data stands.

- :class:`MapFeed`: a map-style dataset (``__len__``, ``__getitem__``) through a
  :class:`~service.data.sampler.DataPlan`: one permutation per epoch (or the
  dataset's order), striped over the ranks of the world that runs each step, so a
  resume at any world size feeds every sample once per epoch. With ``shard=False``
  each rank walks its own dataset whole (a world of one per rank): the TBPTT form.
- :class:`StreamFeed`: an iterable dataset (a Hugging Face ``datasets`` stream,
  WebDataset, any ``torch.utils.data.IterableDataset``), each rank reading its own
  shard through torchdata's ``StatefulDataLoader``, whose ``state_dict`` (the
  workers' stream states included) is the position a resume goes on from.

A feed yields :class:`Fed` steps; the loop (:mod:`service.loop.stepping`) times the wait
for each and does the step's bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from service.config import DataConfig
from service.config.errors import Refusal
from service.data.loaders import SignalSafeLoader, shut_down
from service.data.sampler import DataPlan, MicroBatch, PlanSampler, StepPlan
from service.state.preemption import held_back, ignore_in_data_workers

log = logging.getLogger(__name__)


class FeedError(ValueError, Refusal):
    """A dataset the loop cannot feed as asked; the message names the value and the fix."""


@dataclasses.dataclass
class Fed:
    """One optimizer step as the feed gives it: the plan (this rank's share, the cursor) and its micro-batches."""

    plan: StepPlan
    batches: list[Any]
    tokens: int = 0  # set by the step when the task counts them


class MapFeed:
    """A map-style dataset through a :class:`DataPlan` (the task loop's micro-steps, a session's single batch)."""

    stream = False

    def __init__(self, dataset: Dataset, plan: DataPlan, data: DataConfig, seed: int,
                 collate: Callable[[list[Any]], Any] | None) -> None:  # fmt: skip
        self.dataset, self.plan = dataset, plan
        self.sampler = PlanSampler(plan)
        self.loader = SignalSafeLoader(
            dataset, batch_sampler=self.sampler, collate_fn=collate, num_workers=data.num_workers,
            pin_memory=data.pin_memory, persistent_workers=data.num_workers > 0,
            generator=torch.Generator().manual_seed(seed), worker_init_fn=ignore_in_data_workers,
        )  # fmt: skip

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def signature(self) -> tuple[object, ...]:
        """What must stay the same when a loop hands over another dataset object (a range made anew each epoch):
        the data position means the same on it."""
        plan = self.plan
        return "map", plan.length, plan.global_batch, plan.world_size, plan.micro_steps, plan.shuffle, plan.tail

    def steps_in_epoch(self, cursor: int = 0) -> int | None:
        return self.plan.steps_in_epoch(cursor)

    def epoch_done(self, cursor: int) -> bool:
        return cursor >= self.plan.end

    def steps(self, epoch: int, cursor: int) -> Iterator[Fed]:
        """This rank's steps from ``cursor`` to the end of ``epoch``; the loader reads ahead freely."""
        self.sampler.position(epoch, cursor)
        batches, plans, micro_steps = iter(self.loader), self.sampler.plans, self.plan.micro_steps
        for _ in range(self.plan.steps_in_epoch(cursor)):
            fetched = [next(batches) for _ in range(micro_steps)]
            yield Fed(plans.popleft(), fetched)  # the plan of these batches: the sampler handed them out

    def state_dict(self) -> None:
        return None  # the cursor in the loop's state is the whole position

    def load_state_dict(self, state: Any) -> None:
        return None

    def close(self) -> None:
        """Shut the loader's workers down (they would hold the process's exit)."""
        shut_down(self.loader)


def map_plan(dataset: Any, seed: int, batch_size: int, world_size: int, rank: int, shard: bool, shuffle: bool,
             drop_last: bool) -> DataPlan:  # fmt: skip
    """A session's plan: ``batch_size`` per rank per step; ``shard=False``: each rank's own dataset whole."""
    length = len(dataset)
    if not shard:
        return DataPlan(length, seed, batch_size, 1, 0, 1, shuffle=shuffle, tail="drop" if drop_last else "keep")
    return DataPlan(length, seed, batch_size * world_size, world_size, rank, 1, shuffle=shuffle,
                    tail="drop" if drop_last else "keep")  # fmt: skip


# --------------------------------------------------------------------------- streams


def is_hf_stream(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (once torch is imported, it is a torch ``IterableDataset`` too,
    but one that splits its shards over a loader's workers itself)."""
    return any(kind.__module__.startswith("datasets.") and kind.__name__ == "IterableDataset"
               for kind in type(dataset).__mro__)  # fmt: skip


def is_stream(dataset: Any) -> bool:
    """An iterable dataset: torch's ``IterableDataset`` or a Hugging Face ``datasets.IterableDataset``."""
    return isinstance(dataset, IterableDataset) or is_hf_stream(dataset)


def stateful(dataset: Any) -> bool:
    return all(callable(getattr(dataset, method, None)) for method in ("state_dict", "load_state_dict"))


class RankShard(IterableDataset):
    """One rank's shard of a torch ``IterableDataset``: the items whose position in the stream falls in the slot of
    this rank and this loader worker (``get_worker_info``), one in every ``world_size × workers``. Every worker
    reads the stream whole and keeps its slot's items. A stream without ``state_dict`` keeps no position here
    (:class:`StatefulRankShard` is the one with state)."""

    def __init__(self, inner: IterableDataset, rank: int, world_size: int) -> None:
        self.inner, self.rank, self.world_size = inner, rank, world_size
        self.read = 0  # items of the stream this worker has read (its own and the others')

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        slots, slot = self.world_size * workers, self.rank * workers + worker
        for item in self.inner:
            index, self.read = self.read, self.read + 1
            if index % slots == slot:
                yield item

    def set_epoch(self, epoch: int) -> None:
        self.read = 0
        if callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(epoch)  # type: ignore[attr-defined]


class StatefulRankShard(RankShard):
    """A :class:`RankShard` of a stream with ``state_dict``/``load_state_dict``: the state is the stream's own and
    the position read, so it resumes exactly, each worker in its slot."""

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.inner.state_dict(), "read": self.read}  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state["stream"])  # type: ignore[attr-defined]
        self.read = int(state["read"])


def shard_stream(dataset: Any, rank: int, world_size: int, shard: bool) -> Any:
    """This rank's shard: ``split_dataset_by_node`` for a Hugging Face stream (which then splits its shards over the
    loader's workers itself: a :class:`RankShard` over it would lose what the other workers read), a
    :class:`RankShard` otherwise."""
    if not shard or world_size == 1:
        return dataset
    if is_hf_stream(dataset):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return (StatefulRankShard if stateful(dataset) else RankShard)(dataset, rank, world_size)


class StreamFeed:
    """An iterable dataset, batched by torchdata's ``StatefulDataLoader``: one batch per rank per step.

    A stream's shards need not be equally long, so each step the ranks agree (``agree``, the MIN of
    "I have a batch") that all of them have one; the first rank without ends the epoch for all, and the batches
    the others had left are not trained (the uneven tail, like a sampler's ``drop_last``): each rank counts what
    it had left (reading on for at most :attr:`COUNT_SECONDS`), and the epoch's end says so once, per rank
    (:attr:`dropped`).
    """

    COUNT_SECONDS = 5.0  # how long a rank reads on to count the batches an uneven end leaves untrained

    stream = True

    def __init__(self, dataset: Any, batch_size: int, world_size: int, rank: int, data: DataConfig, seed: int,
                 collate: Callable[[list[Any]], Any] | None, agree: Callable[[list[int]], list[int]],
                 shard: bool = True, drop_last: bool = True) -> None:  # fmt: skip
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.source = dataset
        self.dataset = shard_stream(dataset, rank, world_size, shard)
        self.batch_size, self.world_size, self.agree = batch_size, world_size if shard else 1, agree
        self.ranks, self.rank = world_size, rank
        self.resumable = stateful(self.dataset)
        self.dropped = 0  # batches the last epoch's uneven end left untrained, over every rank

        class Loader(SignalSafeLoader, StatefulDataLoader):  # workers start with the stop signals held back
            pass

        self.loader = Loader(self.dataset, batch_size=batch_size, collate_fn=collate, num_workers=data.num_workers,  # type: ignore[call-arg]
                             pin_memory=data.pin_memory, drop_last=drop_last, worker_init_fn=ignore_in_data_workers,
                             snapshot_every_n_steps=1,
                             generator=torch.Generator().manual_seed(seed))  # fmt: skip
        self._pending: Any = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def signature(self) -> tuple[object, ...]:
        """A stream's position is its loader's: another stream object cannot go on from it."""
        return "stream", id(self.source), self.batch_size

    def steps_in_epoch(self, cursor: int = 0) -> int | None:
        try:
            length = len(self.source)
        except TypeError:
            return None
        full = length // self.global_batch
        return max(0, full - cursor // self.global_batch)

    def epoch_done(self, cursor: int) -> bool:
        """Whether ``max_steps`` fell on the end of an epoch: not known of a stream (its end shows only when it is
        read), so no; a resume reads on in this epoch, and finds its end if it was there."""
        return False

    def steps(self, epoch: int, cursor: int) -> Iterator[Fed]:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        with held_back():
            batches = iter(self.loader)
        start, self.dropped = cursor, 0
        while True:
            batch = next(batches, None)
            every, no_rank = self.agree([batch is not None, batch is None])
            if not every:
                if not no_rank:  # some ranks had a batch, some none: the others' are not trained
                    self._uneven(epoch, start // self.global_batch, batch, batches)
                return
            size = _size(batch)
            plan = StepPlan(epoch=epoch, start=start, size=self.global_batch, micro=(MicroBatch((), 1.0, size),))
            start += self.global_batch
            yield Fed(plan, [batch])

    def _uneven(self, epoch: int, steps: int, batch: Any, batches: Iterator[Any]) -> None:
        """The epoch ends at the first rank with no more batches: count what every rank had left (a collective)."""
        left, capped, until = 0, False, time.monotonic() + self.COUNT_SECONDS
        if batch is not None:
            left = 1
            for _ in batches:
                left += 1
                if time.monotonic() > until:
                    capped = True
                    break
        big = 1 << 62
        counts = self.agree([*(left if rank == self.rank else big for rank in range(self.ranks)), -capped])
        per_rank, any_capped = counts[:-1], counts[-1] < 0
        self.dropped = sum(per_rank)
        listed = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(per_rank))
        log.warning(
            "epoch %d of the stream %s ended after %d steps, at the first rank with no more batches; %s%d batches "
            "of %d samples were left untrained (%s%s). Give every rank an equal share (e.g. a number of shards "
            "that the world size divides) to train them all.",
            epoch, describe_stream(self.source), steps, "at least " if any_capped else "", self.dropped,
            self.batch_size, listed, f", counted for at most {self.COUNT_SECONDS:g} s a rank" if any_capped else "",
        )  # fmt: skip

    def state_dict(self) -> Any:
        """The loader's position (its workers' included); None for a stream without state of its own."""
        return self.loader.state_dict() if self.resumable else None

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Shut the loader's workers down (they would hold the process's exit)."""
        shut_down(self.loader)


def _size(batch: Any) -> int:
    from service.data.batches import BatchError, leading_size

    try:
        return leading_size(batch)
    except BatchError:
        return 0


def describe_stream(dataset: Any) -> str:
    return f"{type(dataset).__module__}.{type(dataset).__name__}"


def check_stream(feed: StreamFeed, max_steps: int | None, epochs: int, resumed: Mapping[str, Any] | None,
                 saved_state: Any, world_size: int, on_resume: str) -> None:  # fmt: skip
    """A stream without a length needs ``train.max_steps``; a resume needs a stream with state, at the world size
    it was saved at, unless ``data.stream_resume: restart`` starts it afresh."""
    if max_steps is None and feed.steps_in_epoch() is None:
        raise FeedError(f"The training data is a stream ({describe_stream(feed.source)}) with no length, so "
                        f"train.epochs={epochs} does not say how long to train. Set train.max_steps (e.g. --set "
                        "train.max_steps=10000).")  # fmt: skip
    if resumed is None:
        if not feed.resumable and on_resume != "restart":
            log.warning("the stream %s has no state_dict/load_state_dict, so its position is not kept: a resume in "
                        "the middle of an epoch will be refused. Give it those two methods, or set "
                        "data.stream_resume=restart to start it afresh on a resume.",
                        describe_stream(feed.source))  # fmt: skip
        return
    if not (resumed.get("loop") or {}).get("cursor"):
        return  # resumed at an epoch's start: the stream starts it afresh, wherever it stood at the save
    fix = ("or set data.stream_resume=restart to start the stream afresh (its samples before the stop may then be "
           "seen again, or some skipped)")  # fmt: skip
    saved_size = resumed.get("world_size")
    if saved_size != world_size:
        if on_resume == "restart":
            log.warning(
                "the stream's position was saved at world size %s, and this start has %d ranks, whose "
                "shards differ: it starts afresh (data.stream_resume=restart)",
                saved_size,
                world_size,
            )
            return
        raise FeedError(
            f"This run resumes a stream ({describe_stream(feed.source)}) whose position was saved at "
            f"world size {saved_size}; this start has {world_size} ranks, and each rank's shard of a "
            f"stream depends on the world size. Resume it with {saved_size} ranks, {fix}."
        )
    if saved_state is None:
        if on_resume == "restart":
            log.warning("the stream %s keeps no position (no state_dict): it starts afresh "
                        "(data.stream_resume=restart)", describe_stream(feed.source))  # fmt: skip
            return
        raise FeedError(f"This run resumes from a checkpoint, but its stream ({describe_stream(feed.source)}) has no "
                        "state_dict/load_state_dict, so where it stopped was not kept. Give the stream state (a "
                        "Hugging Face datasets stream has it; a torch IterableDataset can define state_dict and "
                        f"load_state_dict), {fix}.")  # fmt: skip
    feed.load_state_dict(saved_state)
