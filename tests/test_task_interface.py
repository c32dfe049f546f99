"""The task interface of issue 17: own steps, any batch shape, several eval metrics, own optimizer and schedule,
and the errors an interface mistake gets at the first step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_env, read_summary, run_job
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from service.config import load_config
from service.config.errors import TaskInterfaceError
from service.data.batches import BatchError, checked_collate, leading_size, tensors, to_device
from service.loop.task_step import TaskStep
from service.model.optim import LRSchedule, build_optimizer, build_schedule
from service.tasks.base import Task

Pair = collections.namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    tokens: torch.Tensor
    name: str


def test_batches_of_any_nesting_move_whole_and_keep_their_types() -> None:
    batch = {"a": [torch.ones(2), (torch.zeros(2, 3), "keep")], "b": Pair(torch.ones(2), 3),
             "c": Sample(torch.ones(2, 1), "id"), "d": None}  # fmt: skip
    moved = to_device(batch, torch.device("meta"))
    assert all(tensor.device.type == "meta" for tensor in tensors(moved)) and len(tensors(moved)) == 4
    assert isinstance(moved["b"], Pair) and moved["b"].y == 3 and isinstance(moved["a"][1], tuple)
    assert isinstance(moved["c"], Sample) and moved["c"].name == "id" and moved["a"][1][1] == "keep"
    assert moved["d"] is None and batch["a"][0].device.type == "cpu"  # the original is untouched
    assert leading_size(batch) == 2


@given(st.recursive(st.integers(1, 5).map(lambda n: torch.zeros(n)) | st.text(max_size=3) | st.none(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                max_size=3),
                    max_leaves=10))  # fmt: skip
def test_moving_a_batch_keeps_every_tensor_and_every_other_value(batch) -> None:
    moved = to_device(batch, torch.device("meta"))
    assert [t.shape for t in tensors(moved)] == [t.shape for t in tensors(batch)]
    assert all(t.device.type == "meta" for t in tensors(moved)) and type(moved) is type(batch)
    if not isinstance(batch, (dict, list, torch.Tensor)):
        assert moved == batch  # a string or None passes through as it was


def test_a_batch_without_tensors_cannot_be_counted_and_the_error_names_batch_size_fn() -> None:
    with pytest.raises(BatchError, match="batch_size_fn"):
        leading_size({"names": ["a", "b"]})


def test_the_default_collate_names_collate_fn_for_unequal_samples() -> None:
    collate = checked_collate("mine")
    assert collate([torch.ones(2), torch.ones(2)]).shape == (2, 2)
    with pytest.raises(BatchError, match=r"'mine' have unequal shapes .*collate_fn.*pad_sequence"):
        collate([torch.ones(2), torch.ones(3)])


def _task(**fields: object) -> Task:
    model = nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.ones(4, 3), torch.zeros(4, dtype=torch.long))
    return Task(**{"model": model, "train_set": data, "eval_set": data, **fields})  # type: ignore[arg-type]


def test_a_task_needs_a_step_or_a_loss_and_a_metric_needs_a_name() -> None:
    assert "neither step_fn" in " ".join(_task().problems())
    assert "metric_name" in " ".join(_task(loss_fn=nn.functional.cross_entropy, metric_fn=lambda o, t: o).problems())
    assert _task(step_fn=lambda model, batch: model(batch[0]).sum()).problems() == []


def test_eval_values_are_checked_per_sample_and_named() -> None:
    task = _task(step_fn=lambda m, b: m(b[0]).sum(), eval_fn=lambda m, b: {"loss": m(b[0]).sum(1), "bad": m(b[0])})
    step = TaskStep(task, "mine")
    batch = (torch.ones(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TaskInterfaceError, match=r"'bad' of shape \(4, 2\) for a batch of 4 samples"):
        step.eval_values(task.model, batch, torch.no_grad)
    pairs = TaskStep(_task(loss_fn=nn.functional.cross_entropy, metric_fn=lambda o, t: torch.ones(len(t)),
                           metric_name="acc"), "pairs")  # fmt: skip
    sums, count = pairs.eval_values(task.model, batch, torch.no_grad)
    assert list(sums) == ["loss", "acc"] and count == 4 and sums["acc"].item() == 4.0
    assert pairs.headline(["loss", "acc"]) == "acc" and step.headline(["loss", "f1"]) == "f1"


def test_an_optimizer_of_another_copy_of_the_model_is_refused() -> None:
    task = _task(step_fn=lambda m, b: m(b[0]).sum(), optimizer_fn=lambda module: torch.optim.SGD(
        nn.Linear(3, 2).parameters(), lr=0.1))  # fmt: skip
    with pytest.raises(TaskInterfaceError, match="2 of which are not parameters of the module"):
        build_optimizer(task, "mine", task.model, lambda: torch.optim.SGD(task.model.parameters(), lr=0.1))


def test_a_schedule_steps_per_optimizer_step_and_a_plateau_one_after_each_evaluation() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    task = _task(scheduler_fn=lambda opt, total: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0))
    plateau = build_schedule(task, "mine", optimizer, 10, load_config(None).train, lambda: None)
    plateau.step()  # a no-op: it needs the eval loss
    plateau.evaluated({"loss": 1.0})
    plateau.evaluated({"loss": 2.0})  # no better: the rate drops
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    step_lr = LRSchedule(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))
    step_lr.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    other = torch.optim.SGD(model.parameters(), lr=1.0)
    foreign = _task(scheduler_fn=lambda opt, total: torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(TaskInterfaceError, match="another optimizer"):
        build_schedule(foreign, "mine", optimizer, 10, load_config(None).train, lambda: None)


MISTAKES = {
    "step_returns_tuple": ("TaskInterfaceError", r"returned a tuple of 2 items.*model\(batch\['idx'\], "),
    "loss_not_reduced": ("TaskInterfaceError", r"loss of shape \(4, 8\), not a scalar.*reduction='mean'"),
    "loss_without_grad": ("TaskInterfaceError", r"loss with no grad.*torch\.no_grad\(\)"),
    "dict_batch_without_step": ("TaskInterfaceError", r"batch is a dict\. Give the task a step_fn"),
    "output_without_tensors": ("TaskInterfaceError", r"returned dict with no tensors.*step_fn"),
    "unequal_samples": ("BatchError", r"unequal shapes \(stack expects.*collate_fn"),
    "object_samples": ("BatchError", r"are Record objects.*collate_fn"),
    "shared_buffer": ("BufferBroadcastError", r"single memory location.*`ddp\.broadcast_buffers: false`"),
}


@pytest.mark.e2e
def test_interface_mistakes_fail_at_the_first_step_naming_the_task_and_the_fix(tmp_path: Path) -> None:
    """Each mistake through the real build_job and train, in one process; the fixed variants then train."""
    out = tmp_path / "out.json"
    cases = [*MISTAKES, "shared_buffer+ddp.broadcast_buffers=false", "dict_lm", "varlen"]
    subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "interface_errors.py"), str(out), *cases],
                   cwd=REPO, env=child_env(), check=True, timeout=120)  # fmt: skip
    results = json.loads(out.read_text())
    for name, (kind, pattern) in MISTAKES.items():
        assert results[name] is not None, f"{name} trained without an error"
        found, message = results[name]
        assert found == kind, (name, message)
        assert kind == "BufferBroadcastError" or f"own_step_tasks:{name}" in message, message  # names the task
        assert re.search(pattern, message, re.S), (name, message)
    assert results["shared_buffer+ddp.broadcast_buffers=false"] is None
    assert results["dict_lm"] is None and results["varlen"] is None


@pytest.mark.e2e
def test_own_step_task_trains_with_padded_batches_and_two_exact_eval_means(tmp_path: Path) -> None:
    """varlen: a padding collate into a namedtuple, eval every 3 steps; each mean over every eval sample once."""
    run_dir = tmp_path / "run"
    output = run_job(run_dir, 2, "task=own_step_tasks:varlen", "train.batch_size=5", "train.max_steps=7",
                     "train.eval_every=3", "train.log_every=1", "checkpoint.every_steps=0",
                     start="warm").stdout  # fmt: skip
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["global_step"] == 7
    assert summary["eval_metric"]["name"] == "accuracy" and set(summary["eval_metrics"]) == {"loss", "accuracy"}
    assert [int(step) for step in re_steps(output)] == [3, 6, 7]  # every 3 steps, and the end (not twice)
    # The same means computed here, in one process, on the final weights: every eval sample once, no padding.
    sys.path.insert(0, str(REPO / "tests" / "tasks"))
    from own_step_tasks import VarLen, pad, varlen

    from service.tasks.base import TaskSpec

    task = varlen(TaskSpec(seed=0))
    state = torch.load(sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)
    task.model.load_state_dict(state["model"])
    task.model.eval()
    eval_set = VarLen(20, 1)
    with torch.no_grad():
        values = task.eval_fn(task.model, pad([eval_set[i] for i in range(len(eval_set))]))  # type: ignore[misc]
    for name, value in values.items():
        assert summary["eval_metrics"][name] == pytest.approx(value.double().mean().item(), rel=1e-6), name


def re_steps(output: str) -> list[str]:
    return re.findall(r"\[rank 0\] INFO eval epoch \d+ step (\d+) loss [\d.]+ accuracy [\d.]+", output)


@pytest.mark.e2e
def test_dict_batches_and_own_optimizer_resize_two_one_three_with_every_sample_once(tmp_path: Path) -> None:
    """dict_lm (dict batches, step_fn, its own AdamW groups and StepLR): SIGTERM at 2 ranks, at 1 (a world of one
    without a launcher), finish at 3."""
    from test_resume_e2e import manifest_steps, preempt_agent_at, read_trace

    length, global_batch, epochs = 48, 12, 2
    job = ("task=own_step_tasks:dict_lm", f"task_options.train_size={length}", "task_options.sleep=0.05",
           "train.batch_size=2", f"train.global_batch_size={global_batch}", f"train.epochs={epochs}",
           "train.log_every=1", "checkpoint.every_steps=2", "data.trace=true")  # fmt: skip
    run_dir = tmp_path / "run"
    first = preempt_agent_at(run_dir, 2, 1, *job, start_as="warm")
    second = preempt_agent_at(run_dir, 1, first["stopped_at_step"] + 1, *job, start_as="alone")
    assert 0 < first["stopped_at_step"] < second["stopped_at_step"] < epochs * length // global_batch
    assert second["resumed_from"]["step"] == first["stopped_at_step"] and manifest_steps(run_dir)
    run_job(run_dir, 3, *job, start="warm")
    final = read_summary(run_dir)
    steps = epochs * length // global_batch
    assert final["status"] == "completed" and final["world_size"] == 3
    assert (final["global_step"], final["samples_seen"], final["global_batch_size"]) == (steps, epochs * length,
                                                                                       global_batch)  # fmt: skip
    trace = read_trace(run_dir)
    assert {line["world_size"] for line in trace} == {1, 2, 3}
    for epoch in range(epochs):
        seen = sorted(index for line in trace if line["epoch"] == epoch for index in line["indices"])
        assert seen == list(range(length)), f"epoch {epoch}: a sample is missing or repeated"
    assert sum(1 for line in trace if line["rank"] == 0) == steps  # no step ran twice
    # The task's own optimizer and schedule came through both resumes: its two groups, and the StepLR that
    # stepped once per optimizer step of the whole run (step_size = total // 3 = 2: three halvings by step 8).
    state = torch.load(sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)
    assert [group["weight_decay"] for group in state["optimizer"]["param_groups"]] == [0.1, 0.0]
    assert state["scheduler"]["last_epoch"] == steps
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-3 * 0.5 ** (steps // 2))
    assert final["eval_metric"]["name"] == "token_accuracy"
    assert set(final["eval_metrics"]) == {"loss", "token_accuracy"}


@pytest.mark.e2e
def test_a_tasks_state_is_kept_and_its_step_fn_logs_more_than_the_loss(tmp_path):
    """#25.3: ``Task.state`` is saved and restored like the model (a counter its step advances goes on from the
    resumed step), and ``step_fn`` may return ``(loss, {name: number})``: each number's world mean is logged."""
    run_dir = tmp_path / "run"
    job = ("task=own_step_tasks:lm_with_state", "train.log_every=1", "train.batch_size=4", "train.epochs=5")
    run_job(run_dir, 1, *job, "train.max_steps=3", start="alone")
    done = run_job(run_dir, 1, *job, "train.max_steps=6", start="alone")
    summary = read_summary(run_dir)
    assert summary["resumed_from"]["step"] == 3 and summary["global_step"] == 6
    assert summary["logged"]["counted"] == 6.0  # 3 before the resume, restored, then 3 more
    assert re.search(r"INFO step 6/6 epoch \d+ loss [\d.]+ counted 6 twice [\d.]+ lr", done.stdout), done.stdout[-2000:]
    assert summary["logged"]["twice"] == pytest.approx(2 * summary["logged"]["loss"])


@pytest.mark.e2e
def test_a_tasks_stateful_torch_stream_is_sharded_over_ranks_and_workers_and_resumes_exactly(tmp_path):
    """#25.2: a ``torch.utils.data.IterableDataset`` with ``state_dict`` as ``Task.train_set``, 2 processes x 2
    loader workers (each takes one item in every four): a run to step 4, then to 8, ends as a run to 8 does (a
    constant LR: a cosine over 4 steps is another schedule than over 8). #35.1, the Task loop: an endless stream
    stopped by max_steps, its loaders' workers still reading, exits within seconds of its end, its loaders' workers
    shut down with it."""
    from test_resume_e2e import run_and_exit_within

    job = ("task=stream_tasks:numbers", "train.batch_size=4", "data.num_workers=2", "train.log_every=1",
           "train.lr_schedule=constant")  # fmt: skip
    run_and_exit_within(tmp_path / "straight", 2, *job, "train.max_steps=8", done=r"\[rank 0\] INFO done: step 8,")
    run_job(tmp_path / "run", 2, *job, "train.max_steps=4", start="warm")
    run_job(tmp_path / "run", 2, *job, "train.max_steps=8", start="warm")
    straight, resumed = read_summary(tmp_path / "straight"), read_summary(tmp_path / "run")
    assert resumed["resumed_from"]["step"] == 4 and resumed["global_step"] == straight["global_step"] == 8
    assert resumed["model_digest"] == straight["model_digest"]
