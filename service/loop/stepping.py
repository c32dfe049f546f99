"""The steps of a run and the boundary between two of them, where the service works: one copy for every loop.

:func:`steps` yields one optimizer step's batches at a time (a :class:`~service.data.feeds.Fed`); the loop runs
its step (the task loop's micro-steps and optimizer step, or a script's own code) and asks for the next. Between
the two, on every rank at the same steps: the step is counted (the data position moves), the log window and the
sinks hear of it, the preemption agreement may stop every rank here, and the periodic checkpoint and snapshot are
taken. ``max_steps`` and the epochs of the config bound the whole. What a loop adds at the boundary (the task
loop's evaluations) comes in through :class:`Hooks`.
"""

from __future__ import annotations

import _random
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from service.data.feeds import Fed
from service.telemetry.metrics import StepReport
from service.telemetry.progress import CHECKPOINT, DATA, hang_timeout

if TYPE_CHECKING:
    from service.data.feeds import MapFeed, StreamFeed
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


_PYTHON_RANDOM: random.Random = random.seed.__self__  # type: ignore[attr-defined]  # the one random.seed seeds
_seed_python = _random.Random.seed  # random.seed's own work: for an int its Python wrapper only checks the type


def seed_step(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Seed torch (this device's generator too), ``random`` and numpy: the same state as ``torch.manual_seed``'s
    generator, ``random.seed`` and ``np.random.seed`` give, in about 14 µs of CPU (torch 3, random 8, numpy 3)."""
    value = step_seed(seed, step, rank)
    torch.default_generator.manual_seed(value)  # torch.manual_seed visits every backend: 60 µs
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    _seed_python(_PYTHON_RANDOM, value)
    _PYTHON_RANDOM.gauss_next = None  # type: ignore[attr-defined]  # as random.seed does: gauss() draws afresh
    np.random.seed(value)


def steps(rt: Runtime, feed: MapFeed | StreamFeed, hooks: Hooks = Hooks(), one_epoch: bool = False,
          call: str = "s.batches(...)") -> Iterator[Fed]:  # fmt: skip
    """The run's steps from where it stands to ``total_steps`` (``one_epoch``: to the end of this epoch); on a stop
    agreed by the ranks, ``rt.stopped`` says why (the step that just ran is kept)."""
    rt.begin(feed, call)
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
    from service.data.feeds import FeedError, describe_stream

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
    state, plan = rt.state, fed.plan
    state.global_step += 1
    seconds = time.perf_counter() - started
    rt.progress.stepped(state.global_step, seconds)
    state.cursor = plan.end
    state.samples_seen += plan.size
    micro = plan.micro
    reals = micro[0].real if len(micro) == 1 else sum(part.real for part in micro)
    rt.window.step(reals)
    rt.roles.sink.on_step(reals, seconds, fetched - started, fed.tokens)
    rt.roles.trace.record(plan, state.global_step)
    rt.startup.mark("first_step")


def finish_in_flight(rt: Runtime) -> None:
    """A loop left its ``for`` after a step's body (a ``break``): that step counts, with no boundary collective."""
    if rt.in_flight is not None:
        fed, started, fetched = rt.in_flight
        rt.in_flight = None
        count_step(rt, fed, started, fetched)


LEFT = "session-left/"  # the store keys of the ranks that left their loop before its end
POLL = 0.2  # seconds between two looks at the store while a rank waits for the others to leave


@dataclasses.dataclass(frozen=True)
class Left:
    """A loop left before its end (a ``break``, a ``return``, ``sys.exit(0)``) after step ``step``'s body: the ranks
    known to have left there, whether every rank did, and the ranks seen going on past that step."""

    step: int
    ranks: list[int]
    every_rank: bool
    went_on: list[int] = dataclasses.field(default_factory=list)

    def describe(self) -> dict[str, object]:
        """``summary.json``'s ``left_loop``."""
        return {"step": self.step, "ranks": self.ranks, "every_rank": self.every_rank, "went_on": self.went_on}

    def message(self) -> str:
        """Why the job ends: the ranks that left, those that went on, and the fix."""
        others = f"rank(s) {', '.join(map(str, self.went_on))} went on" if self.went_on else "the others did not"
        return (f"rank(s) {', '.join(map(str, self.ranks))} left the loop after step {self.step} (a break, return or "
                f"sys.exit(0) inside `for ... in s.batches(...)`), and {others}: every rank must leave at the same "
                "step, or the ranks that go on wait for them in their next collective. Decide to stop from a value "
                "every rank shares (average it over the ranks first, e.g. torch.distributed.all_reduce, or stop at "
                "a step count), or let train.max_steps end the run.")  # fmt: skip


def went_on(record: dict[str, object] | None, step: int, left_at: int | None) -> bool:
    """A peer's watchdog record shows it past the body of step ``step``: it counted that step at its boundary (a
    rank that leaves notes so in the store before it counts the step: ``left_at``, the step it left after) or
    left after a later one."""
    if record is None:
        return False
    if left_at is not None:
        return left_at > step
    return int(record["step"]) >= step  # type: ignore[call-overload]


def leave(rt: Runtime, clock: Callable[[], float] = time.monotonic) -> Left | None:
    """A loop left its ``for`` after a step's body: that step counts (:func:`finish_in_flight`) and the ranks learn,
    through the store, whether every one of them left there (None: no step was in flight, the loop ran out).

    The other ranks do not stop by themselves: a rank that goes on meets no agreement before its next step's
    collectives, since the stop agreement runs only every few steps. So each rank that left notes the step in the
    store and waits for every rank to have left there. It stops waiting once a peer is seen past that step (its
    watchdog record, published every second, counts the step without having left) or left at another, and at the
    hang timeout at the latest: then the job must end.
    """
    if rt.in_flight is None:
        return None
    step, rank, size = rt.state.global_step + 1, rt.world.rank, rt.world.world_size
    if size == 1:
        finish_in_flight(rt)
        return Left(step, [rank], True)
    from service.telemetry.watchdog import PREFIX, StoreCaller, parse_record

    store = StoreCaller(rt.dist_ctx.store)
    store.call(lambda st: st.set(f"{LEFT}rank-{rank}", str(step)))  # before the step counts: see went_on
    store.call(lambda st: st.add(f"{LEFT}count", 1))
    finish_in_flight(rt)
    rt.progress.mark(CHECKPOINT)  # waiting for peers that save or leave: no hang of its own
    key = f"{LEFT}step-{step}"
    store.call(lambda st: st.add(key, 1))
    deadline = clock() + hang_timeout(rt.config.dist.hang_timeout_seconds, rt.progress.p99(),
                                      rt.config.dist.timeout_seconds)  # fmt: skip
    peers = [other for other in range(size) if other != rank]

    watched = StoreCaller(torch.distributed.PrefixStore(PREFIX, rt.dist_ctx.store))  # the watchdog's keys

    def records(st: Any) -> dict[int, bytes | None]:
        return {other: st.get(str(other)) if st.check([str(other)]) else None for other in peers}

    while True:
        answered, count = store.call(lambda st: st.add(key, 0))
        if answered and count >= size:
            return Left(step, list(range(size)), True)
        answered, raw = watched.call(records)
        left = left_peers(rt, store)  # read after the records: a peer that left noted it before its record moved
        ahead = sorted(other for other, value in (raw or {}).items()
                       if value is not None and went_on(parse_record(value), step, left.get(other)))  # fmt: skip
        if ahead or any(at != step for at in left.values()) or clock() > deadline:
            return Left(step, sorted(left) or [rank], False, ahead)
        time.sleep(POLL)


def left_peers(rt: Runtime, store: Any = None) -> dict[int, int]:
    """The ranks that left their loop before its end in this attempt (:func:`leave`) and the step each left after,
    from the store; empty when none did or the store does not answer (each call a bounded wait)."""
    from service.telemetry.watchdog import StoreCaller

    if rt.world.world_size == 1 or rt.dist_ctx.store is None:
        return {}
    store = store or StoreCaller(rt.dist_ctx.store)
    answered, count = store.call(lambda st: st.add(f"{LEFT}count", 0))
    if not answered or not count:
        return {}
    keys = {other: f"{LEFT}rank-{other}" for other in range(rt.world.world_size)}
    answered, found = store.call(lambda st: {other: int(st.get(key)) for other, key in keys.items()
                                             if st.check([key])})  # fmt: skip
    return dict(found) if answered else {}


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
    if rt.save_due(state.global_step):  # a step with no save due holds the thread for no save: nothing to tell
        roles.sink.on_checkpoint_stall(time.perf_counter() - saving)
    return None
