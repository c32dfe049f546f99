"""Issue 25's pure parts: what is kept and how it comes back, the faithful defaults, the session's command line and
the feeds' plans; no torchrun (tests/test_session_e2e.py runs the real programs). Issue 39's: the step boundary's
order, a break's step, the feed cache, a stream's plans and a snapshot's per-rank state, on the real loop functions
with a stand-in for the runtime's outside (a process group of one in memory where a collective runs)."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from service.config import ConfigError, DataConfig, load_config
from service.data.dataset_feed import dataset_feed
from service.data.feeds import FeedError, MapFeed, StreamFeed, map_plan
from service.data.sampler import DataPlan, epoch_order
from service.loop.kept import Carry, KeepError, Kept, Variables
from service.loop.runtime import Runtime
from service.loop.session import Session, refuse_unused, split_argv
from service.loop.stepping import Hooks, steps
from service.model.optim import clip_setting, describe_defaults, schedule_setting
from service.state.loop_state import LoopState
from service.state.snapshot_interval import SnapshotSchedule
from service.tasks.base import Task

DATA = [(torch.zeros(2), torch.zeros(1))] * 4


@pytest.fixture
def world_of_one():
    """A process group of one in this process (an in-memory store): the gather's collectives run for real."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def saved(kept: Kept) -> dict:
    """What a checkpoint holds of ``kept`` (the shared states, and this rank's own as the gather gives them)."""
    return {**kept.states(), "world_size": kept.world_size, "rank_kept": {str(kept.rank): {
        name: obj.state_dict() for name, obj in kept.per_rank.items()}}}  # fmt: skip


def test_kept_objects_come_back_in_the_call_that_keeps_them_and_per_rank_ones_only_at_the_same_world_size(caplog):
    torch.manual_seed(0)
    net, carry = nn.Linear(2, 2), Carry(torch.tensor([3.0]))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    before = Kept(None, 1, 2)
    before.keep({"net": net, "opt": optimizer}, False, "s.keep")
    before.keep({"hidden": carry}, True, "s.keep_rank")
    state = saved(before)

    fresh, fresh_carry = nn.Linear(2, 2), Carry()
    again = Kept(state, 1, 2, "step-4.pt")
    again.keep({"net": fresh}, False, "s.keep")
    assert torch.equal(fresh.weight, net.weight)  # loaded in the call itself
    again.keep({"hidden": fresh_carry}, True, "s.keep_rank")
    assert fresh_carry.take() == torch.tensor([3.0]) and fresh_carry.take("default") == "default"  # once

    resized, resized_carry = Kept(state, 0, 3, "step-4.pt"), Carry("as built")
    with caplog.at_level(logging.WARNING):
        resized.keep({"hidden": resized_carry}, True, "s.keep_rank")
        resized.keep({"other": Carry()}, True, "s.keep_rank")
    assert resized_carry.value == "as built" and resized_carry.take() is None
    assert caplog.text.count("saved at world size 2") == 1 and "hidden" in caplog.text  # one warning naming them


def test_a_resume_names_the_missing_and_the_unexpected_kept_objects():
    before = Kept(None, 0, 1)
    before.keep({"netG": nn.Linear(2, 2), "netD": nn.Linear(2, 2)}, False, "s.keep")
    state = saved(before)
    with pytest.raises(KeepError, match=r"holds no 'optG'.*Unexpected: optG\. Missing so far: netD"):
        Kept(state, 0, 1, "x").keep({"netG": nn.Linear(2, 2), "optG": Carry()}, False, "s.keep")
    partial = Kept(state, 0, 1, "x")
    partial.keep({"netG": nn.Linear(2, 2)}, False, "s.keep")
    with pytest.raises(KeepError, match=r"holds netD, which this run never kept before s\.batches.*Missing: netD"):
        partial.close("s.batches(...)")


def test_a_checkpoint_from_before_kept_reads_as_a_task_jobs_four_and_a_missing_scaler_as_none():
    net = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    old = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    loaded = []

    class Scaler:
        def state_dict(self) -> None:
            return None

        def load_state_dict(self, state: object) -> None:
            loaded.append(state)

    kept = Kept(old, 0, 1, "old.pt")
    kept.keep({"model": nn.Linear(2, 2), "optimizer": optimizer, "scheduler": scheduler, "scaler": Scaler()}, False,
              "the task's state")  # fmt: skip
    kept.close("the task loop's first step")
    assert loaded == [None]


def test_variables_keep_a_scripts_own_names_and_refuse_one_not_set_yet():
    namespace = {"lr": 20.0, "best_val_loss": None}
    kept = Variables(namespace, "lr", "best_val_loss")
    state = kept.state_dict()
    namespace.update(lr=5.0, best_val_loss=4.2)
    kept.load_state_dict(state)
    assert namespace == {"lr": 20.0, "best_val_loss": None}
    with pytest.raises(KeepError, match="epoch not defined yet"):
        Variables(namespace, "epoch")


def test_faithful_defaults_add_no_schedule_and_no_clipping_to_a_tasks_own_optimizer(caplog):
    """#25.4: the VAE's Adam at lr 1e-3 annealed to 0 over 4 steps under the service's cosine, and every port was
    clipped at 1.0; with its own optimizer a task gets neither unless the config asks, and the start says so."""
    train = load_config(None).train
    own = Task(nn.Linear(2, 2), DATA, DATA, loss_fn=nn.functional.mse_loss,
               optimizer_fn=lambda module: torch.optim.Adam(module.parameters(), lr=1e-3))  # fmt: skip
    plain = Task(nn.Linear(2, 2), DATA, DATA, loss_fn=nn.functional.mse_loss)
    assert (schedule_setting(own, train), clip_setting(own, train)) == ("constant", None)
    assert (schedule_setting(plain, train), clip_setting(plain, train)) == ("cosine", 1.0)
    asked = load_config(None, ["train.lr_schedule=linear", "train.grad_clip=0.25"]).train
    assert (schedule_setting(own, asked), clip_setting(own, asked)) == ("linear", 0.25)
    with caplog.at_level(logging.INFO, logger="service.loop.train"):
        describe_defaults(own, "vae", train)
    assert "optimizer the task's optimizer_fn; LR schedule constant (train.lr_schedule=auto)" in caplog.text
    assert "gradient clipping off (train.grad_clip=auto)" in caplog.text


def test_a_session_refuses_config_keys_its_script_would_not_get():
    with pytest.raises(ConfigError) as raised:
        refuse_unused(load_config(None, ["train.grad_clip=1.0", "train.lr_schedule=cosine", "init_from=w.pt"]))
    text = str(raised.value)
    assert "train.grad_clip=1.0" in text and "train.lr_schedule=cosine" in text and "init_from" in text
    refuse_unused(load_config(None))  # the defaults are a session's


@given(st.lists(st.sampled_from(["--config", "--set", "-v", "x", "--set=a=1", "--config=j.yaml", "train.lr=1"]),
                max_size=8))  # fmt: skip
def test_the_session_takes_its_own_arguments_off_the_command_line_and_leaves_the_rest(argv):
    try:
        path, overrides, rest = split_argv(argv)
    except ConfigError:
        assert argv and argv[-1] in ("--config", "--set")  # a flag with no value after it
        return
    assert "--config" not in rest and "--set" not in rest
    assert [item for item in rest if not item.startswith(("--set=", "--config="))] == rest
    assert len(rest) + len(overrides) + (path is not None) <= len(argv)


@given(st.integers(1, 300), st.integers(1, 16), st.integers(1, 5), st.booleans(), st.booleans())
def test_a_sessions_plan_hands_every_rank_whole_samples_and_no_sample_twice(length, batch, world, shuffle, drop):
    """drop_last: only whole steps; else a last step where every rank has at least one sample (no filler a script
    would train on). Every sample of the steps taken is seen once."""
    dataset = range(length)
    seen: list[int] = []
    for rank in range(world):
        plan = map_plan(dataset, 7, batch, world, rank, True, shuffle, drop)
        for step in plan.steps(0, 0):
            assert all(part.real and len(part.indices) == part.real for part in step.micro)
            seen += step.indices
    assert len(seen) == len(set(seen))
    full = length // (batch * world) * batch * world
    assert len(seen) in ((full,) if drop else (full, length))
    if not shuffle:
        assert epoch_order(length, 7, 0, False).tolist() == list(range(length))


# --- issue 39: the step boundary, the session's feeds and a stream's plans, on stand-ins for the runtime ----------


def loop_stub(total_steps: int, preempt_at: int | None = None) -> tuple[Any, list[tuple[str, int]]]:
    """A runtime for :func:`service.loop.stepping.steps` with no process group: the real loop state and the real
    step boundary; what it calls out to records itself in ``calls`` (evaluations, saves, the end)."""
    calls: list[tuple[str, int]] = []
    rt = MagicMock()
    rt.state, rt.total_steps, rt.stopped, rt.in_flight, rt.summary = LoopState(), total_steps, None, None, None
    rt.config = load_config(None, ["train.log_every=1000"])
    rt.world.rank, rt.world.world_size, rt.device = 0, 1, torch.device("cpu")
    rt.preemption.stop_here.return_value = None
    rt.preemption.stop_now.side_effect = lambda: "preempted" if rt.state.global_step == preempt_at else None
    rt.save_due.side_effect = lambda step: calls.append(("save_due", step))
    rt.finish.side_effect = lambda status, *extra: calls.append((status, rt.state.global_step))
    return rt, calls


def map_feed(length: int = 12, batch: int = 2) -> MapFeed:
    return MapFeed(TensorDataset(torch.arange(length)), map_plan(range(length), 0, batch, 1, 0, True, False, True),
                   DataConfig(), 0, None)  # fmt: skip


def test_a_preempted_step_is_counted_and_skips_its_evaluation_and_its_periodic_save():
    """Issue 39 (1): at the boundary the preemption agreement comes before the loop's evaluation and the periodic
    checkpoint and snapshot: a preempted step is kept (counted; its checkpoint is the end's), but neither evaluated
    nor saved twice. (The agreement moved after them: a stop paid an evaluation and a save first.)"""
    rt, calls = loop_stub(total_steps=6, preempt_at=3)
    hooks = Hooks(boundary=lambda: calls.append(("eval", rt.state.global_step)) or None)
    taken = [fed.plan.start for fed in steps(rt, map_feed(), hooks)]
    assert taken == [0, 2, 4] and rt.stopped == "preempted" and rt.state.global_step == 3
    assert calls == [("eval", 1), ("save_due", 1), ("eval", 2), ("save_due", 2)]


def test_a_break_after_a_steps_body_counts_that_step_at_the_sessions_end():
    """Issue 39 (3): a script that leaves ``for batch in s.batches(...)`` with a ``break`` after its step's body
    trained that step: the session's end counts it (its data position, its samples) before the last checkpoint."""
    rt, calls = loop_stub(total_steps=6)
    session = Session()
    session._runtime = rt
    for taken, _ in enumerate(session._batches(map_feed()), 1):
        if taken == 3:
            break
    session.close()
    assert calls == [("save_due", 1), ("save_due", 2), ("completed", 3)]
    assert (rt.state.global_step, rt.state.cursor, rt.state.samples_seen) == (3, 6, 6)


def test_a_second_s_batches_with_another_drop_last_is_another_feed_which_the_run_refuses():
    """Issue 39 (4): the session's feeds are cached by what makes them; ``drop_last`` is part of that, so a second
    ``s.batches`` with another ``drop_last`` gets its own feed, whose signature differs (the runtime refuses it,
    naming drop_last) instead of silently reusing the first one's plan."""
    rt = SimpleNamespace(config=load_config(None), world=SimpleNamespace(world_size=1, rank=0), control=None,
                         label="script", resumed=None)  # fmt: skip
    session = Session()
    session._runtime = rt
    data = list(range(7))
    dropped = session._feed(data, 2, None, False, True, True)
    assert session._feed(data, 2, None, False, True, True) is dropped  # the same call: the same feed
    kept = session._feed(data, 2, None, False, True, False)
    assert kept is not dropped and kept.plan.tail == "keep" and dropped.plan.tail == "drop"
    assert kept.signature() != dropped.signature()
    assert (dropped.plan.steps_in_epoch(0), kept.plan.steps_in_epoch(0)) == (3, 4)


def test_the_task_loop_and_a_session_build_their_feeds_in_one_factory():
    """Issue 37: one feed factory for both doors. The task loop's plan (``tail="fill"``, its micro-steps) is the
    one it built on its own before: 2 ranks x 2 samples x 2 micro-steps a step; a stream with micro-steps is
    refused before any work, naming the settings to leave unset."""
    rt = SimpleNamespace(config=load_config(None), world=SimpleNamespace(world_size=2, rank=1), control=None,
                         label="task", resumed=None)  # fmt: skip
    feed = dataset_feed(rt, list(range(10)), 2, tail="fill", micro_steps=2, call="the task 'x''s train_set")
    assert feed.plan == DataPlan(10, rt.config.seed, 8, 2, 1, 2)
    assert (feed.plan.steps_in_epoch(0), feed.plan.end) == (2, 10)  # the last step filled from the epoch's start
    session_feed = dataset_feed(rt, list(range(10)), 2, tail="keep")
    assert session_feed.plan == DataPlan(10, rt.config.seed, 4, 2, 1, 1, tail="keep")
    with pytest.raises(FeedError, match=r"the task 'x''s train_set got a stream.*Leave train\.grad_accum"):
        dataset_feed(rt, Counting(8), 2, tail="fill", micro_steps=2, call="the task 'x''s train_set")


class Counting(torch.utils.data.IterableDataset):
    """A stream of 0, 1, 2, ... (``length`` items; ``len`` when ``sized``), with a position a resume loads."""

    def __init__(self, length: int, sized: bool = True) -> None:
        self.length, self.sized, self.start = length, sized, 0

    def __iter__(self):
        yield from range(self.start, self.length)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no length")
        return self.length

    def state_dict(self) -> dict:
        return {"start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["start"]


def test_a_streams_step_plans_start_at_the_cursor_and_a_sized_streams_resume_counts_the_steps_left():
    """Issue 39 (5): each step of a stream starts where the last one ended (the cursor), so the data position, the
    session's ``epoch_step`` and the steps left of a stream with a length after a resume are those of the batches
    read. (A plan one global batch late put the cursor a step ahead: a resumed epoch ended a step early.)"""
    feed = StreamFeed(Counting(10), 2, 1, 0, DataConfig(), 0, None, agree=lambda values: list(values))
    assert feed.steps_in_epoch(0) == 5
    fed = list(feed.steps(0, 0))
    assert [(f.plan.start, f.plan.end) for f in fed] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert [f.batches[0].tolist() for f in fed] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    resumed = list(itertools.islice(feed.steps(0, 4), 2))  # a resume at cursor 4 (two steps taken)
    assert [(f.plan.start, f.plan.end) for f in resumed] == [(4, 6), (6, 8)]
    assert feed.steps_in_epoch(resumed[-1].plan.end) == 1

    rt, _ = loop_stub(total_steps=5)
    rt.feed = feed
    session = Session()
    session._runtime = rt
    positions = []
    for _ in session._batches(feed):
        positions.append(session.epoch_step)  # the steps before this one, in this epoch
    assert positions == [0, 1, 2, 3, 4] and session.epoch_step == 5 and rt.state.cursor == 10


def test_per_rank_state_is_gathered_for_a_snapshot_only_step_and_a_resume_from_it_gets_that_steps_value(
    world_of_one,
):
    """Issue 39 (2): a step with a snapshot due and no checkpoint still gathers every rank's own kept state
    (``keep_rank``), so the snapshot holds that step's value, and a session resumed from it gets it back. (Gathered
    only for checkpoints, a snapshot carried the state of the last checkpoint, or none.)"""
    hidden = Carry(torch.zeros(2))
    rt = object.__new__(Runtime)
    rt.config, rt.config_json = load_config(None, ["checkpoint.every_steps=100"]), {}
    rt.world, rt.control = SimpleNamespace(world_size=1, rank=0), world_of_one
    rt.kept = Kept(None, 0, 1)
    rt.kept.keep({"net": nn.Linear(2, 2)}, False, "s.keep")
    rt.kept.keep({"hidden": hidden}, True, "s.keep_rank")
    rt.snapshot_schedule = SnapshotSchedule(1, 0, lambda: [], agree=lambda p: p)
    rt.state, rt.feed, rt.nonfinite, rt._rank_kept, rt.digest, rt.lineage = LoopState(), None, None, {}, "h", "L"
    snapshots: list[dict] = []
    checkpointer = SimpleNamespace(maybe_save=lambda step, state: None, lineage="L")
    capture = SimpleNamespace(capture=lambda step, state: snapshots.append(state()))
    rt.roles = SimpleNamespace(checkpointer=checkpointer, snapshots=capture)
    for step in (1, 2, 3):
        hidden.value = torch.full((2,), float(step))
        rt.state.global_step = step
        rt.save_due(step)
    assert len(snapshots) == 3
    again = Carry()
    Kept(snapshots[-1], 0, 1, "snapshot").keep({"hidden": again}, True, "s.keep_rank")
    assert again.take().tolist() == [3.0, 3.0]


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4)


@given(st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                    max_size=3), max_leaves=12))  # fmt: skip
def test_summary_json_is_strict_json_with_non_finite_numbers_as_null(value):
    """#35.1: s.log(nan) wrote NaN into summary.json, which no strict JSON reader takes; now null, at any depth."""
    import json
    import math

    from service.telemetry.summary import strict, summary_json

    def same(read, given):
        if isinstance(given, float) and not math.isfinite(given):
            return read is None
        if isinstance(given, (list, tuple)):
            return isinstance(read, list) and len(read) == len(given) and all(map(same, read, given))
        if isinstance(given, dict):
            return read.keys() == given.keys() and all(same(read[key], given[key]) for key in given)
        return read == given

    read = json.loads(summary_json({"logged": value}), parse_constant=_no_constants)
    assert same(read["logged"], value) and same(strict(value), value)


def test_the_summary_writer_writes_nan_and_inf_as_null(tmp_path):
    import json

    from service.telemetry.summary import JsonSummaryWriter

    JsonSummaryWriter(tmp_path / "summary.json").write({"logged": {"loss": float("nan"), "gain": float("-inf"),
                                                                   "lr": 0.1}, "final_loss": float("inf")})  # fmt: skip
    text = (tmp_path / "summary.json").read_text()
    assert json.loads(text, parse_constant=_no_constants) == {"logged": {"loss": None, "gain": None, "lr": 0.1},
                                                              "final_loss": None}  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "code"),
    [(None, 0), (SystemExit(), 0), (SystemExit(0), 0), (SystemExit(3), 3), (SystemExit(True), 1),
     (SystemExit("a message"), 1), (RuntimeError("x"), 1), (KeyboardInterrupt(), 1)],
)  # fmt: skip
def test_the_exit_status_an_exception_gives_is_pythons(exc, code):
    from service.state.preemption import exit_code_of

    assert exit_code_of(exc) == code


@pytest.mark.e2e
def test_a_refusal_is_an_ordinary_error_to_catch_and_an_exit_2_when_uncaught():
    """KeepError and FeedError: `except Exception` catches them as before; uncaught, Python exits 2 with no
    traceback (they are SystemExits of code 2), whatever their message."""
    import subprocess
    import sys

    from service.data.feeds import FeedError

    for error in (KeepError("the names differ"), FeedError("a stream saved at world size 2")):
        assert isinstance(error, Exception) and isinstance(error, SystemExit) and error.code == 2
        assert str(error) in ("the names differ", "a stream saved at world size 2")
    done = subprocess.run([sys.executable, "-c", "from service.loop.kept import KeepError\n"
                           "raise KeepError('the names differ')"], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr


def test_a_peer_went_on_once_its_record_counts_the_step_left_at_and_it_did_not_leave_there():
    from service.loop.stepping import Left, went_on

    assert not went_on(None, 3, None)
    for step, left_at, ahead in ((2, None, False), (3, None, True), (4, None, True), (3, 3, False), (2, 2, False),
                                 (4, 4, True)):  # fmt: skip
        assert went_on({"step": step, "phase": "boundary"}, 3, left_at) is ahead, (step, left_at)
    message = Left(3, [1], False, [0]).message()
    assert message.startswith("rank(s) 1 left the loop after step 3") and "rank(s) 0 went on" in message
    assert "train.max_steps" in message


# --- issue 38: the step boundary's own cost, without a behaviour lost -----------------------------------------------


def test_the_boundary_tells_the_sinks_of_a_checkpoint_stall_only_at_steps_with_a_save_due():
    """A step with neither a checkpoint nor a snapshot due holds the thread for no save: no stall to add up (the
    goodput ledger's checkpoint time, a fan-out over every sink at every step before)."""
    rt, calls = loop_stub(total_steps=6)
    rt.save_due.side_effect = lambda step: calls.append(("save_due", step)) or step % 3 == 0
    stalls: list[float] = []
    rt.roles.sink.on_checkpoint_stall.side_effect = stalls.append
    assert len(list(steps(rt, map_feed(), Hooks()))) == 6
    assert [step for name, step in calls if name == "save_due"] == [1, 2, 3, 4, 5, 6]
    assert len(stalls) == 2 and all(seconds >= 0 for seconds in stalls)


def test_the_steps_seed_gives_the_states_random_numpy_and_torch_give_for_that_seed():
    """seed_step seeds ``random`` without its Python wrapper: the same state (gauss's cached draw dropped too) as
    ``random.seed``, numpy's and torch's as their own seed calls give."""
    import random

    import numpy as np

    from service.loop.stepping import seed_step, step_seed

    def draws() -> tuple[Any, ...]:
        return random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(()).item()

    value = step_seed(3, 17, 1)
    random.seed(value), np.random.seed(value), torch.manual_seed(value)  # type: ignore[func-returns-value]
    expected = draws()
    random.gauss(0, 1)  # leaves a cached second draw behind, which the seed must drop
    seed_step(3, 17, 1, torch.device("cpu"))
    assert draws() == expected


@given(st.integers(1, 9000), st.integers(1, 40), st.integers(1, 4), st.integers(1, 3), st.integers(0, 5000))
def test_a_plan_read_through_blocks_of_the_order_is_the_plan_read_from_the_tensor(length, batch, world, micro, at):
    """Issue 38: the steps of an epoch slice its order from a block of Python ints, not the tensor (4 µs a step):
    every step's plan is the same, across block edges and at the epoch's end."""
    from service.data.sampler import Blocks, DataPlan

    plan = DataPlan(length, 3, batch * world, world, world - 1, micro, tail="fill")
    order = epoch_order(length, 3, 1)
    cursor = min(at, length) // plan.global_batch * plan.global_batch
    starts = range(cursor, plan.end, plan.global_batch)
    expected = [plan.step(order, 1, start) for start in starts]
    assert list(plan.steps(1, cursor)) == expected
    small = Blocks(order)
    small.BLOCK = 7  # many block edges, some inside a step
    assert [plan.step(small, 1, start) for start in starts] == expected


@given(norms=st.lists(st.sampled_from([1.0, float("inf"), float("nan")]), min_size=1, max_size=150),
       read_at=st.integers(0, 149))  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_the_guard_records_the_first_non_finite_step_whenever_it_is_read(tmp_path_factory, norms, read_at):
    """Issue 38: the guard (``train.nonfinite=stop``) keeps each step's norm and folds them into its device record
    when it is read (a check, a snapshot's state) or every 64 steps, not four device ops a step: the record is
    still the first step whose gradient norm was inf or nan, at any step it is read."""
    from service.model import nonfinite

    guard = nonfinite.NonfiniteGuard("stop", 1.0, torch.device("cpu"), tmp_path_factory.mktemp("c"), (), 10**6)
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    for step, norm in enumerate(norms, 1):
        weight.grad = torch.tensor([norm])
        guard.step([weight], optimizer, step)
        if step == read_at:
            bad = [at for at, value in enumerate(norms[:step], 1) if value != 1.0]
            assert int(guard.first_bad) == (bad[0] if bad else -1)
    bad = [at for at, value in enumerate(norms, 1) if value != 1.0]
    assert int(guard.first_bad) == (bad[0] if bad else -1)
