"""A dataset as a feed (:mod:`service.data.feeds`), checked first: the one factory of both doors, a session's
``s.batches`` and the task loop's training set."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, WeightedRandomSampler

from service.data.batches import checked_collate
from service.data.feeds import FeedError, MapFeed, StreamFeed, is_stream, map_plan
from service.world.distributed import all_agree

_REPLACEMENT = ("a sampler that draws with replacement has no s.batches form: s.batches draws a permutation each "
                "epoch (every sample once, the same order at every world size, resumed exactly); to draw with "
                "replacement, pass a stream instead (an IterableDataset whose __iter__ draws indices from a "
                "torch.Generator, with state_dict/load_state_dict) and set train.max_steps")  # fmt: skip


def loader_given(loader: DataLoader, batch_size: Any) -> str:
    """What replaces each setting of a DataLoader a script hands to ``s.batches``: its own loader is not used."""
    sampler = getattr(loader, "sampler", None)
    with_replacement = getattr(sampler, "replacement", False) or isinstance(sampler, WeightedRandomSampler)
    parts = [
        f"pass its dataset: s.batches(loader.dataset, batch_size={loader.batch_size or batch_size})",
        "its collate_fn goes to s.batches(..., collate_fn=...)",
        "shuffle to s.batches(..., shuffle=...), drop_last to s.batches(..., drop_last=...)",
        f"num_workers={loader.num_workers} and pin_memory={loader.pin_memory} to the config's data.num_workers and "
        f"data.pin_memory (--set data.num_workers={loader.num_workers})",
    ]
    if with_replacement:
        parts.append(_REPLACEMENT)
    return (
        "s.batches got a torch DataLoader; the session makes its own loader (its sampler is what resumes "
        f"exactly, across world sizes), so this one's settings would be lost: {'; '.join(parts)}."
    )


log = logging.getLogger("service.loop.train")


def dataset_feed(rt: Any, dataset: Any, batch_size: Any, collate_fn: Callable[[list[Any]], Any] | None = None, *,
                 shuffle: bool = True, shard: bool = True, tail: str = "keep", micro_steps: int = 1,
                 call: str = "s.batches") -> MapFeed | StreamFeed:  # fmt: skip
    """A feed of ``batch_size`` samples per rank and micro-step, ``micro_steps`` a step; every rank must call it
    alike (it may agree).

    ``tail``: an epoch's last samples short of a whole step: ``keep`` them (a smaller step), ``drop`` them, or
    ``fill`` the step from the epoch's start (the task loop's); a stream, which cannot fill, drops them then.
    ``call`` names the caller in the errors (``s.batches``, the task's training set).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise FeedError(f"s.batches(dataset, batch_size={batch_size!r}): batch_size is the samples per rank and step, "
                        "a whole number of at least 1, e.g. s.batches(dataset, batch_size=64).")  # fmt: skip
    if collate_fn is not None and not callable(collate_fn):
        raise FeedError(f"s.batches(..., collate_fn={collate_fn!r}): collate_fn must be a function of a list of "
                        "samples, e.g. torch.utils.data.default_collate, or None.")  # fmt: skip
    if isinstance(dataset, DataLoader):
        raise FeedError(loader_given(dataset, batch_size))
    config, world = rt.config, rt.world
    collate = collate_fn or checked_collate(rt.label)
    agree = all_agree(rt.control)
    if is_stream(dataset):
        if micro_steps != 1:
            raise FeedError(f"{call} got a stream, which gives one batch of {batch_size} samples per rank and step; "
                            "gradient accumulation over a stream is not supported. Leave train.grad_accum and "
                            "train.global_batch_size unset.")  # fmt: skip
        return StreamFeed(dataset, batch_size, world.world_size, world.rank, config.data, config.seed, collate, agree,
                          shard=shard, drop_last=tail != "keep")  # fmt: skip
    if not (callable(getattr(dataset, "__len__", None)) and callable(getattr(dataset, "__getitem__", None))):
        raise FeedError(f"{call} got a {type(dataset).__name__}, which is neither a map-style dataset (__len__ and "
                        "__getitem__) nor an iterable one (torch.utils.data.IterableDataset, a datasets stream). "
                        "Pass a Dataset, a list of samples, or a stream.")  # fmt: skip
    length = len(dataset)
    if not shard:
        shortest, longest = agree([length, -length])
        if shortest != -longest:
            raise FeedError(f"s.batches(..., shard=False): the ranks' own datasets have {shortest} to {-longest} "
                            f"samples (this rank: {length}); every rank must take the same number of steps, so give "
                            "each rank a share of the same length (batchify trims the remainder: trim it to a "
                            "length every rank shares).")  # fmt: skip
        saved = rt.resumed.state.get("world_size") if rt.resumed is not None else None
        if saved is not None and saved != world.world_size:
            log.warning(
                "s.batches(..., shard=False) resumes at world size %d a position saved at world size %s: each "
                "rank goes on at the same index of its own (new) share of the data",
                world.world_size,
                saved,
            )
    if length < 1:
        raise FeedError(f"{call} got an empty dataset; check how it is built.")
    plan = map_plan(dataset, config.seed, batch_size, world.world_size, world.rank, shard, shuffle, tail == "drop")
    if tail == "fill" or micro_steps != 1:
        plan = dataclasses.replace(plan, global_batch=plan.global_batch * micro_steps, micro_steps=micro_steps,
                                   tail=tail)  # fmt: skip
    if plan.steps_in_epoch(0) == 0:
        raise FeedError(f"{call}: {length} samples make no whole step of {plan.global_batch} "
                        f"({batch_size} per rank x {plan.world_size} rank(s)) with drop_last=True; lower batch_size "
                        "or pass drop_last=False.")  # fmt: skip
    return MapFeed(dataset, plan, config.data, config.seed, collate)
