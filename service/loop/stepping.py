"""The steps of a run and the boundary between two of them, where the service works: one copy for every loop.

:func:`steps` yields one optimizer step's batches at a time (a :class:`~service.loop.feeds.Fed`); the loop runs
its step (the task loop's micro-steps and optimizer step, or a script's own code) and asks for the next. Between
the two, on every rank at the same steps: the step is counted (the data position moves), the log window and the
sinks hear of it, the preemption agreement may stop every rank here, and the periodic checkpoint and snapshot are
taken. ``max_steps`` and the epochs of the config bound the whole. What a loop adds at the boundary (the task
loop's evaluations) comes in through :class:`Hooks`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from service.loop.feeds import Fed
from service.loop.progress import CHECKPOINT, DATA
from service.telemetry.metrics import StepReport

if TYPE_CHECKING:
    from service.loop.feeds import MapFeed, StreamFeed
    from service.loop.runtime import Runtime

log = logging.getLogger("service.loop.train")


def _nothing(*args: object) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a loop adds at the step boundary; a script's own loop adds nothing but what ``report`` does."""

    stepped: Callable[[int], None] = _nothing  # a step is counted (the task loop's non-finite check)
    boundary: Callable[[], str | None] = _nothing  # after the stop agreement, before the saves; may stop (eval_every)
    epoch_start: Callable[[], None] = _nothing  # the model back in training mode
    epoch_end: Callable[[bool], None] = _nothing  # an epoch's steps are done (True: the run's last)
    after_epoch: Callable[[], None] = _nothing  # the epoch's end is in the state (checkpoint.best of its evaluation)
    reported: Callable[[StepReport], None] = _nothing  # a log line's numbers (a script's checkpoint.best)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one optimizer step on one rank: dropout and augmentation replay exactly on resume."""
    return ((seed * 1_000_003 + step) * 7_919 + rank) % 2**32


def seed_step(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Seed torch (this device's generator too), ``random`` and numpy; about 5 µs, so every step can."""
    value = step_seed(seed, step, rank)
    torch.default_generator.manual_seed(value)  # torch.manual_seed visits every backend: 60 µs
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def steps(rt: Runtime, feed: MapFeed | StreamFeed, hooks: Hooks = Hooks(), one_epoch: bool = False,
          why: str = "s.batches(...)") -> Iterator[Fed]:  # fmt: skip
    """The run's steps from where it stands to ``total_steps`` (``one_epoch``: to the end of this epoch); on a stop
    agreed by the ranks, ``rt.stopped`` says why (the step that just ran is kept)."""
    rt.begin(feed, why)
    state, epochs = rt.state, rt.config.train.epochs
    while rt.stopped is None:
        if stop := rt.preemption.stop_here():  # a signal in start-up, the last evaluation or checkpoint
            rt.stopped = stop
            return
        if feed.stream and state.epoch >= epochs:  # a map-style dataset's epochs are in total_steps already
            return
        before, fresh = state.global_step, state.cursor == 0
        reason = yield from _epoch(rt, feed, hooks)
        if reason in ("preempted", "lock_lost"):
            rt.stopped = reason
            return
        state.dropped_batches += getattr(feed, "dropped", 0)
        if reason == "epoch" and fresh and state.global_step == before:
            _empty_epoch(rt, feed)  # a stream that gave nothing: the run ends here, or is refused
            return
        if reason == "epoch":
            state.epochs_completed += 1
        hooks.epoch_end(state.global_step >= rt.total_steps)
        if reason == "epoch":
            state.epoch, state.cursor = state.epoch + 1, 0
        hooks.after_epoch()
        if state.global_step >= rt.total_steps or one_epoch:
            return


def _empty_epoch(rt: Runtime, feed: MapFeed | StreamFeed) -> None:
    """An epoch that gave no step (every rank agreed, at its start): a stream that does not start again (a
    generator read once, a rank's shard used up). Refused before any step; after some, the run ends here (no
    epoch is left: a rerun trains nothing more), saying why."""
    from service.loop.feeds import FeedError, describe_stream

    state, train = rt.state, rt.config.train
    name = describe_stream(getattr(feed, "source", feed))
    fix = ("Make the stream's __iter__ start it afresh at each call (an IterableDataset whose __iter__ is a "
           "generator function, not one generator object made once)")  # fmt: skip
    if state.global_step == 0:
        size = getattr(feed, "batch_size", feed.global_batch)
        raise FeedError(f"The stream {name} gave no batch in epoch {state.epoch} (batch_size {size} per rank): some "
                        "rank has no whole batch to train. Check that it yields samples on every rank (a shard for "
                        f"each), and lower batch_size if it yields fewer. {fix}.")  # fmt: skip
    log.warning("the stream %s gave no batch in epoch %d (after %d steps in the epochs before): it does not start "
                "again, so the run ends here at step %d, before the %d steps planned. %s, or set "
                "train.epochs=%d to end it after the epochs it has.", name, state.epoch, state.global_step,
                state.global_step, rt.total_steps, fix, max(1, state.epoch))  # fmt: skip
    state.epoch = max(state.epoch, train.epochs)  # the data is over: no epoch is left to train


def _epoch(rt: Runtime, feed: MapFeed | StreamFeed, hooks: Hooks) -> Generator[Fed, None, str]:
    """Steps from the cursor to the end of the epoch; why it stopped: ``epoch`` (done), ``steps`` (total_steps
    reached), ``preempted`` (a rank was signalled) or ``lock_lost`` (rank 0 lost the run_dir lock)."""
    state, progress = rt.state, rt.progress
    if state.global_step >= rt.total_steps:
        return "steps"
    progress.mark(DATA)
    hooks.epoch_start()
    seed, rank, device = rt.config.seed, rt.world.rank, rt.device
    fed_steps = feed.steps(state.epoch, state.cursor)
    while True:
        started = time.perf_counter()  # host timers only: no device sync for the metrics
        progress.mark(DATA)
        fed = next(fed_steps, None)
        if fed is None:
            return "epoch"
        fetched = time.perf_counter()
        rt.startup.mark("first_batch")
        seed_step(seed, state.global_step, rank, device)
        rt.in_flight = (fed, started, fetched)
        yield fed
        rt.in_flight = None
        if stop := _boundary(rt, fed, hooks, started, fetched):
            return stop
        if state.global_step >= rt.total_steps:
            return "epoch" if feed.epoch_done(state.cursor) else "steps"


def count_step(rt: Runtime, fed: Fed, started: float, fetched: float) -> None:
    """The step is done: count it, move the data position, tell the sinks and the trace."""
    state = rt.state
    state.global_step += 1
    rt.progress.stepped(state.global_step, time.perf_counter() - started)
    state.cursor = fed.plan.end
    state.samples_seen += fed.plan.size
    reals = sum(part.real for part in fed.plan.micro)
    rt.window.step(reals)
    rt.roles.sink.on_step(reals, time.perf_counter() - started, fetched - started, fed.tokens)
    rt.roles.trace.record(fed.plan, state.global_step)
    rt.startup.mark("first_step")


def finish_in_flight(rt: Runtime) -> None:
    """A loop left its ``for`` after a step's body (a ``break``): that step counts, with no boundary collective."""
    if rt.in_flight is not None:
        fed, started, fetched = rt.in_flight
        rt.in_flight = None
        count_step(rt, fed, started, fetched)


def _boundary(rt: Runtime, fed: Fed, hooks: Hooks, started: float, fetched: float) -> str | None:
    state, roles = rt.state, rt.roles
    count_step(rt, fed, started, fetched)
    hooks.stepped(state.global_step)
    if state.global_step % rt.config.train.log_every == 0:
        report = rt.last_report = rt.window.report(state, rt.total_steps, rt.lr())
        roles.sink.on_report(report)
        hooks.reported(report)
    if stop := rt.preemption.stop_now():
        return stop
    if stop := hooks.boundary():
        return stop
    rt.progress.mark(CHECKPOINT)
    rt.kept.check_loadable()  # once, on every rank: state a resume could not load is never saved
    saving = time.perf_counter()
    rt.save_due(state.global_step)
    roles.sink.on_checkpoint_stall(time.perf_counter() - saving)
    return None
