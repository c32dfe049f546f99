"""Loaders that give each rank its share: a resumable plan for training, a plain stride for eval."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from service.config import DataConfig
from service.data.sampler import StepPlan
from service.state.preemption import held_back, ignore_in_data_workers
from service.world.env import WorldInfo


def shut_down(loader: Any, wait: float = 5.0) -> None:
    """Stop ``loader``'s worker processes now, not at the interpreter's exit.

    A loader's workers ignore the stop signals (:func:`~service.state.preemption.ignore_in_data_workers`), and
    at exit Python's ``multiprocessing`` ends its daemonic children with SIGTERM and joins them: with a loader
    still open (a stream cut by ``max_steps``, an epoch another rank ended, a stop) that join never returns. So
    the loops shut their loaders down themselves: the workers are told to stop and joined, and one still alive
    after ``wait`` seconds is killed.
    """
    iterator = getattr(loader, "_iterator", None)
    with contextlib.suppress(AttributeError):
        loader._iterator = None
    stop = getattr(iterator, "_shutdown_workers", None)
    if not callable(stop):
        return
    workers = list(getattr(iterator, "_workers", ()))
    with contextlib.suppress(Exception):  # a worker that died already: what is left is killed below
        stop()
    deadline = time.monotonic() + wait
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=wait)


class SignalSafeLoader(DataLoader):
    """A DataLoader whose worker processes start with the preemption signals blocked.

    A signal in the moment a worker starts (torchrun signals the whole process
    group) would otherwise kill it before its ``worker_init_fn`` ignores the
    signal, and fail the job. Workers start in ``iter()``: once for persistent
    ones, at every pass for the eval loader's. Forked and spawned workers
    inherit the mask (Linux's default start method here is fork).
    """

    def __iter__(self) -> _BaseDataLoaderIter:
        if not self.num_workers:
            return super().__iter__()
        with held_back():
            return super().__iter__()


def eval_loader(dataset: Dataset, batch_size: int, data: DataConfig, world: WorldInfo,
                collate: Callable[[list[Any]], Any] | None = None) -> DataLoader:  # fmt: skip
    """Every eval sample exactly once across ranks: no padding duplicates, so all-reduced means are exact."""
    shard = range(world.rank, len(dataset), world.world_size)  # type: ignore[arg-type]
    return SignalSafeLoader(dataset, batch_size=batch_size, sampler=shard, num_workers=data.num_workers,
                            pin_memory=data.pin_memory, worker_init_fn=ignore_in_data_workers,
                            collate_fn=collate)  # fmt: skip


class SampleTrace:
    """Records nothing: the default (``data.trace: false``)."""

    def record(self, plan: StepPlan, global_step: int) -> None:
        return None

    def close(self) -> None:
        return None


class FileSampleTrace(SampleTrace):
    """One JSON line per optimizer step with the sample indices this rank consumed (``run_dir/trace/``).

    Written after the step, so the union of every rank's lines is what the
    optimizer saw; the file name carries the world size and rank, so the
    ranks of worlds before and after a resize never share a file.
    """

    def __init__(self, directory: Path, world: WorldInfo) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.world = world
        self.file = open(directory / f"world{world.world_size}-rank{world.rank}.jsonl", "a")  # noqa: SIM115

    def record(self, plan: StepPlan, global_step: int) -> None:
        line = {"epoch": plan.epoch, "step": global_step, "start": plan.start, "size": plan.size,
                "rank": self.world.rank, "world_size": self.world.world_size, "indices": plan.indices}  # fmt: skip
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
