"""Issue 35.3/35.4's pure parts: micro-batches, kept RNG objects, s.steps' feed, the rank-0 console, the settings a
session refuses, and how its config merges with the command line; no process group (the e2e file runs them)."""

from __future__ import annotations

import io
import random
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from service.config import ConfigError, load_config
from service.data.geometry import plan_total_steps
from service.loop.kept import Kept
from service.loop.roles import Console, LeadConsole
from service.loop.session import Session, SessionError, refuse_unused
from service.loop.session_loop import EpochCount
from service.loop.session_tools import NONFINITE_FIX, CountFeed, ToolError, _numbers, split_batch
from service.model.nonfinite import NonfiniteError, NonfiniteGuard
from service.state.checkpoint_io import load_tensors
from service.state.loop_state import LoopState


@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 4))
def test_micro_batches_cut_every_tensor_of_a_batch_into_equal_parts_that_join_back(parts, per_part, width):
    x = torch.arange(parts * per_part * width, dtype=torch.float32).reshape(parts * per_part, width)
    y = torch.arange(parts * per_part)
    batch = {"x": x, "pair": (x, y)}
    split = split_batch(batch, parts)
    assert len(split) == parts and all(len(part["x"]) == per_part for part in split)
    assert torch.equal(torch.cat([part["x"] for part in split]), x)
    assert torch.equal(torch.cat([part["pair"][1] for part in split]), y)
    assert all(type(part["pair"]) is tuple for part in split)


def test_a_batch_that_does_not_split_evenly_is_refused_naming_the_fix():
    with pytest.raises(ToolError, match=r"shape \(6, 2\) does not split into train\.grad_accum=4.*multiple of 4"):
        split_batch([torch.zeros(6, 2)], 4)
    with pytest.raises(ToolError, match=r"got a str inside the batch"):
        split_batch(["text"], 2)


def _saved(kept: Kept) -> dict:
    """The kept states as a checkpoint holds them: through torch.save and the resume's safe loader."""
    buffer = io.BytesIO()
    torch.save({**kept.states(), "world_size": 1}, buffer)
    return load_tensors(buffer.getvalue(), "test")


def test_a_scripts_own_random_generators_are_kept_and_come_back_through_the_safe_loader():
    rngs = {
        "torch_rng": torch.Generator().manual_seed(3),
        "py_rng": random.Random(3),
        "np_rng": np.random.default_rng(3),
    }
    kept = Kept(None, 0, 1)
    kept.keep(rngs, False, "s.keep")
    torch.rand(1, generator=rngs["torch_rng"]), rngs["py_rng"].random(), rngs["np_rng"].random()  # move them
    state = _saved(kept)
    expected = (torch.rand(2, generator=rngs["torch_rng"]), rngs["py_rng"].random(), rngs["np_rng"].random(2))
    fresh = {"torch_rng": torch.Generator(), "py_rng": random.Random(), "np_rng": np.random.default_rng()}
    Kept(state, 0, 1, "step-1.pt").keep(fresh, False, "s.keep")  # restored in the call
    assert torch.equal(torch.rand(2, generator=fresh["torch_rng"]), expected[0])
    assert fresh["py_rng"].random() == expected[1]
    assert np.array_equal(fresh["np_rng"].random(2), expected[2])


def test_the_steps_feed_goes_on_from_its_cursor_and_ends_after_n():
    feed = CountFeed(5)
    assert [fed.batches[0] for fed in feed.steps(0, 2)] == [2, 3, 4]
    assert [fed.plan.end for fed in feed.steps(0, 3)] == [4, 5]
    assert feed.steps_in_epoch(3) == 2 and feed.epoch_done(5) and not feed.epoch_done(4)


def test_numbers_come_back_as_the_kind_they_were():
    values, rebuild = _numbers(torch.tensor([[1.5, 2.0]], dtype=torch.float32), "s.sum")
    back = rebuild([3.0, 4.0])
    assert values == [1.5, 2.0] and back.shape == (1, 2) and back.dtype == torch.float32
    assert _numbers(7, "s.sum")[1]([9.0]) == 9.0
    with pytest.raises(ToolError, match=r"s\.sum\(str\)"):
        _numbers("x", "s.sum")


def test_rank_zero_prints_and_goes_first_the_others_print_nothing_and_wait(capsys):
    order: list[str] = []
    with LeadConsole().first(lambda: order.append("wait")):
        order.append("body")
    with Console().first(lambda: order.append("wait")):
        order.append("body")
    assert order == ["body", "wait", "wait", "body"]
    LeadConsole().print("from rank 0")
    Console().print("from rank 1")
    assert capsys.readouterr().out == "from rank 0\n"


def test_a_session_refuses_the_optimizer_keys_and_the_global_batch_naming_what_replaces_them():
    with pytest.raises(ConfigError) as raised:
        refuse_unused(load_config(None, ["train.optimizer=adamw", "train.lr=0.1", "train.warmup_steps=5",
                                         "train.global_batch_size=64"]))  # fmt: skip
    text = str(raised.value)
    assert "train.optimizer=adamw: the script builds its own optimizer" in text
    assert "train.lr=0.1: the script builds its own optimizer: pass the learning rate to it" in text
    assert "train.warmup_steps=5: the script builds its own schedule" in text
    assert "train.global_batch_size=64" in text and "train.grad_accum and s.micro_batches(batch)" in text
    refuse_unused(load_config(None, ["train.grad_accum=4", "train.amp=fp16", "train.nonfinite=skip"]))  # the tools'


def test_overrides_merge_with_the_command_line_which_wins_and_leaves_the_scripts_own_arguments(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--set", "train.epochs=5", "data.txt", "--set=seed=9", "-v"])
    config = Session(overrides=["train.epochs=3", "train.max_steps=7"])._load_config()
    assert (config.train.epochs, config.train.max_steps, config.seed) == (5, 7, 9)
    assert sys.argv == ["train.py", "data.txt", "-v"]


def test_a_sessions_non_finite_step_advises_only_what_a_session_takes(tmp_path):
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    guard = NonfiniteGuard("stop", None, torch.device("cpu"), tmp_path, (), 1)
    guard.fix = NONFINITE_FIX  # what s.step sets
    param.grad = torch.tensor([float("nan"), 1.0])
    guard.step([param], optimizer, 1)
    with pytest.raises(NonfiniteError) as raised:
        guard.check(1)
    text = str(raised.value)
    assert "s.step(optimizer, max_norm=...)" in text and "train.lr" not in text and "train.grad_clip" not in text


def _epochs_session(overrides: list[str], resumed: dict | None = None) -> tuple[Session, Any]:
    """A session on a stand-in runtime: the real config, loop state and kept objects (``resumed``: a checkpoint's)."""
    rt = SimpleNamespace(config=load_config(None, overrides), state=LoopState(), stopped=None, total_steps=0,
                         kept=Kept(resumed, 0, 1, "step-8.pt"),
                         resumed=SimpleNamespace(state=resumed) if resumed is not None else None)  # fmt: skip
    session = Session()
    session._runtime = rt
    return session, rt


def _walk(session: Session, rt: Any, n: int | None) -> list[int]:
    """The epochs ``s.epochs(n)`` gives, each run to its end."""
    seen = []
    for epoch in session.epochs(n):
        seen.append(epoch)
        rt.state.epoch += 1
    return seen


def test_s_epochs_takes_the_scripts_count_as_the_runs_epochs_bounding_its_steps_and_keeping_it():
    session, rt = _epochs_session([])
    rt.state.epoch = 1  # a resume in epoch 1
    assert _walk(session, rt, 4) == [1, 2, 3]
    assert rt.config.train.epochs == 4 and session.config is rt.config
    assert plan_total_steps(CountFeed(5), LoopState(), rt.config.train) == 20  # bounds the run as train.epochs does
    assert rt.kept.states()["__epochs__"] == {"epochs": 4}  # in every checkpoint
    assert _walk(session, rt, 4) == []  # the same count again: nothing left
    same, rt = _epochs_session(["train.epochs=3"])  # train.epochs given, and equal: fine
    assert _walk(same, rt, 3) == [0, 1, 2]
    default, rt = _epochs_session([])
    assert _walk(default, rt, None) == [0, 1]  # s.epochs(): train.epochs (default 2), nothing kept
    assert "__epochs__" not in rt.kept.shared


@pytest.mark.parametrize(
    ("overrides", "first", "n", "match"),
    [
        (["train.epochs=2"], None, 3, r"s\.epochs\(3\) and train\.epochs=2 \(the config or --set\) both set"),
        ([], None, 0, r"s\.epochs\(0\): n is the run's number of epochs, a whole number of at least 1"),
        ([], None, True, r"s\.epochs\(True\): n is"),
        ([], 3, 4, r"s\.epochs\(4\) came after s\.epochs\(3\)"),
    ],
)
def test_s_epochs_refuses_a_conflicting_train_epochs_a_bad_count_and_a_second_count(overrides, first, n, match):
    session, _ = _epochs_session(overrides)
    if first is not None:
        session.epochs(first)
    with pytest.raises(SessionError, match=match) as raised:
        session.epochs(n)
    assert raised.value.code == 2  # uncaught: exit 2, no traceback


def test_a_resume_must_pass_the_count_it_started_with():
    before = Kept(None, 0, 1)
    before.keep({"net": torch.nn.Linear(1, 1), "__epochs__": EpochCount(3)}, False, "s.keep")
    state = {**_saved(before), "config": {"train": {"epochs": 2}}}
    session, rt = _epochs_session([], state)
    with pytest.raises(SessionError, match=r"s\.epochs\(5\): the run this resumes from counted 3 epochs"):
        session.epochs(5)
    session, rt = _epochs_session([], state)
    session.epochs(3)  # the same count: loaded, and on
    assert rt.config.train.epochs == 3
    plain = Kept(None, 0, 1)
    plain.keep({"net": torch.nn.Linear(1, 1)}, False, "s.keep")
    session, _ = _epochs_session([], {**_saved(plain), "config": {"train": {"epochs": 2}}})
    with pytest.raises(SessionError, match=r"counted its epochs by train\.epochs=2, not by s\.epochs\(n\)"):
        session.epochs(2)
