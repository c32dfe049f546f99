"""More tests aimed at plausible bugs that the rest of the suite let through (issue 20).

Each test was watched failing once against its bug, planted alone into the tree, and passing once it was reverted:

1. the per-step RNG reseed removed (``seed_step`` not called)   → ``test_every_step_draws_from_its_own_seed_per_rank``
2. prune counts a state file without a manifest as kept
   → ``test_prune_does_not_count_a_state_file_without_a_manifest``
3. the directory fsync after the renames removed
   → ``test_the_directory_is_fsynced_after_both_renames_and_before_any_prune``
4. no barrier after the preemption save
   → ``test_no_rank_reports_preempted_before_rank0_saved_that_step``
5. loss weights applied only when accumulating
   → ``test_ranks_average_to_the_one_rank_gradient_over_a_whole_uneven_epoch``
6. the node lease TTL longer than keep_alive_interval × keep_alive_max_attempt (it needs the etcd fixtures)
   → tests/rendezvous/test_native.py::
     ``test_a_node_that_dies_leaves_within_the_lease_ttl_and_steady_state_writes_nothing``
7. ``train.nonfinite: skip`` still stepping the optimizer
   → ``test_a_skipped_nan_step_moves_no_weight_and_no_optimizer_state``
8. the parent-death signal sent as SIGTERM
   → ``test_an_orphan_dies_by_sigkill_without_the_watchdog_and_saves_nothing``

Pure logic (2, 3, 5, 7) runs on real files and the real loop functions in-process; 1, 4 and 8 run real processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_env, kill_group, read_summary, run_job
from torch import nn

from service.state import checkpoint_io
from service.state.checkpoint import Rank0Checkpointer
from service.state.checkpoint_io import manifest_name, prune, read_verified, state_name, write_checkpoint

HASH = "0" * 64


def _state(step: int) -> dict:
    return {"format": 1, "model": {"w": torch.full((16,), float(step))}, "optimizer": {}, "scheduler": {},
            "loop": {"global_step": step}, "rng": {}, "config": {}}  # fmt: skip


# -- 2. a state file without a manifest is no kept checkpoint -------------------------------------------------


def test_prune_does_not_count_a_state_file_without_a_manifest(tmp_path: Path) -> None:
    """Complete 3 and 4, step 5 state only (a crash between the two renames), complete 6: keep=2 keeps 4 and 6."""
    directory = tmp_path / "checkpoints"
    for step in (3, 4, 5, 6):
        write_checkpoint(directory, step, _state(step), HASH)
    (directory / manifest_name(5)).unlink()  # what a crash after the state's rename and before the manifest's leaves
    prune(directory, 2, 6)
    for step in (4, 6):
        manifest, _ = read_verified(directory, step)  # raises if either file went
        assert manifest.step == step
    names = sorted(path.name for path in directory.iterdir())
    assert manifest_name(3) not in names and state_name(3) not in names, f"step 3 should have been pruned: {names}"


# -- 3. the directory entry of both renames is fsynced before anything is pruned --------------------------------


def test_the_directory_is_fsynced_after_both_renames_and_before_any_prune(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    events: list[tuple[str, str]] = []
    real_replace, real_fsync, real_unlink = os.replace, os.fsync, os.unlink

    def replace(src, dst, *args, **kwargs):  # noqa: ANN001, ANN202
        real_replace(src, dst, *args, **kwargs)
        events.append(("rename", Path(dst).name))

    def fsync(fd):  # noqa: ANN001, ANN202
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync-dir", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def unlink(path, *args, **kwargs):  # noqa: ANN001, ANN202
        real_unlink(path, *args, **kwargs)
        events.append(("unlink", Path(path).name))

    saver = Rank0Checkpointer(directory, every_steps=1, keep=2, config_hash=HASH, on_error="stop", async_save=False)
    for step in (1, 2):
        saver.maybe_save(step, lambda step=step: _state(step))
    monkeypatch.setattr(checkpoint_io.os, "replace", replace)
    monkeypatch.setattr(checkpoint_io.os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    saver.maybe_save(3, lambda: _state(3))  # writes step 3, then prunes step 1
    monkeypatch.undo()
    saver.close()
    assert events[:3] == [("rename", state_name(3)), ("rename", manifest_name(3)), ("fsync-dir", str(directory))], (
        f"expected both renames, then an fsync of {directory}, before anything else: {events}"
    )
    assert sorted(events[3:]) == [("unlink", manifest_name(1)), ("unlink", state_name(1))], events


# -- 5. every step weighted, with or without accumulation ------------------------------------------------------


class _Gradients:
    """Stands where the nonfinite guard calls ``optimizer.step()``: keeps what one rank hands DDP's all-reduce."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def step(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, step: int) -> None:
        self.steps.append([p.grad.detach().clone() for p in params])  # type: ignore[union-attr]


def _rank_gradients(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], global_batch: int, world: int,
                    rank: int, micro_steps: int) -> list[list[torch.Tensor]]:  # fmt: skip
    """The real optimizer_step on one rank's real plan for epoch 0, at fixed weights: each step's gradient."""
    from service.data.sampler import DataPlan
    from service.loop.task_step import TaskStep
    from service.loop.train import optimizer_step
    from service.model.precision import Precision
    from service.state.snapshot import Snapshots
    from service.tasks.base import Task
    from service.telemetry.progress import Progress

    inputs, targets = data
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = _Gradients()
    job = types.SimpleNamespace(model=model, params=list(model.parameters()), device=torch.device("cpu"),
                                autocast=contextlib.nullcontext,
                                step=TaskStep(Task(model, data, data, loss_fn=nn.functional.mse_loss), "mse"),
                                precision=Precision(None, torch.device("cpu"), None), nonfinite=recorder,
                                optimizer=optimizer, scheduler=types.SimpleNamespace(step=lambda: None),
                                roles=types.SimpleNamespace(snapshots=Snapshots()), progress=Progress())  # fmt: skip
    plan = DataPlan(len(inputs), 7, global_batch, world, rank, micro_steps)
    for number, step in enumerate(plan.steps(0, 0), 1):
        micro = [(inputs[list(part.indices)], targets[list(part.indices)]) for part in step.micro]
        optimizer_step(job, step, micro, number)  # type: ignore[arg-type]
    return recorder.steps


@pytest.mark.parametrize(
    ("length", "global_batch", "world", "micro_steps"),
    [
        (19, 8, 2, 1),  # last step 3 samples: 2 on rank 0, 1 on rank 1
        (17, 8, 2, 1),  # last step 1 sample, fewer than the world: rank 1 runs a filler of weight 0
        (17, 8, 2, 2),  # the same with accumulation
        (22, 9, 3, 1),  # last step 4 samples over 3 ranks
    ],
)
def test_ranks_average_to_the_one_rank_gradient_over_a_whole_uneven_epoch(length, global_batch, world,
                                                                         micro_steps) -> None:  # fmt: skip
    """DDP averages the ranks' gradients: that average is, step by step, the one rank's gradient of the same step."""
    generator = torch.Generator().manual_seed(3)
    data = (torch.randn(length, 5, generator=generator), torch.randn(length, 1, generator=generator))
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    alone = _rank_gradients(model, data, global_batch, 1, 0, 1)
    ranks = [_rank_gradients(model, data, global_batch, world, rank, micro_steps) for rank in range(world)]
    assert len(alone) == -(-length // global_batch) and all(len(steps) == len(alone) for steps in ranks)
    for step, expected in enumerate(alone, 1):
        averaged = [torch.stack(grads).mean(0) for grads in zip(*(steps[step - 1] for steps in ranks), strict=True)]
        for got, want in zip(averaged, expected, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (
                f"step {step} of {len(alone)}: {world} ranks average to {got.flatten().tolist()}, one rank has "
                f"{want.flatten().tolist()} (the loss weights of an uneven step)"
            )


# -- 7. a skipped step is no step at all -----------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_a_skipped_nan_step_moves_no_weight_and_no_optimizer_state(tmp_path: Path, optimizer: str,
                                                                  grad_clip: float | None) -> None:  # fmt: skip
    """After a good step (momentum and Adam moments are non-zero), a nan step under ``skip`` changes nothing."""
    from service.model.nonfinite import NonfiniteGuard

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01) if optimizer == "sgd"
           else torch.optim.AdamW(params, lr=0.1, weight_decay=0.01))  # fmt: skip
    guard = NonfiniteGuard("skip", grad_clip, torch.device("cpu"), tmp_path, (), 10)
    model(torch.randn(2, 4)).sum().backward()
    guard.step(params, opt, 1)
    opt.zero_grad(set_to_none=True)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    state = {index: {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in slots.items()}
             for index, slots in opt.state_dict()["state"].items()}  # fmt: skip
    assert state, "the good step should have left optimizer state (momentum, moments)"
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    guard.step(params, opt, 2)
    assert guard.skipped == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), f"the skipped step moved {name}: {weights[name]} -> {value}"
    after = opt.state_dict()["state"]
    for index, slots in state.items():
        for key, value in slots.items():
            now = after[index][key]
            same = torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value
            assert same, f"the skipped step changed the optimizer's {key} of parameter {index}: {value} -> {now}"


# -- 1. every step, every rank its own RNG seed ----------------------------------------------------------------


@pytest.mark.e2e
def test_every_step_draws_from_its_own_seed_per_rank(tmp_path: Path) -> None:
    """Each rank's first draw in step k is torch's first draw from ``step_seed(seed, k - 1, rank)``; ranks differ."""
    from service.loop.train import step_seed

    seed, steps, record = 11, 4, tmp_path / "record"
    run_job(tmp_path / "run", 2, "task=probe_tasks:recording_draws", f"task_options.record_dir={record}",
            "task_options.image_size=16", "task_options.train_size=64", "task_options.eval_size=8",
            "train.batch_size=4", f"train.max_steps={steps}", f"seed={seed}", "data.num_workers=0",
            start="warm")  # fmt: skip
    draws = {rank: [json.loads(line) for line in (record / f"draws-rank{rank}.txt").read_text().splitlines()]
             for rank in (0, 1)}  # fmt: skip
    assert all(len(seen) == steps for seen in draws.values()), f"{steps} steps, one forward each: {draws}"
    for step, (first, second) in enumerate(zip(draws[0], draws[1], strict=True), 1):
        assert first != second, f"step {step}: both ranks drew {first} (the same dropout masks on every rank)"
    for rank, seen in draws.items():
        for step, draw in enumerate(seen):
            expected = torch.rand(4, generator=torch.Generator().manual_seed(step_seed(seed, step, rank))).tolist()
            assert draw == expected, (
                f"rank {rank}, step {step + 1}: drew {draw}, but step_seed({seed}, {step}, {rank}) gives {expected}"
            )


# -- 4. nobody leaves before rank 0's preemption save is on disk ------------------------------------------------


@pytest.mark.e2e
def test_no_rank_reports_preempted_before_rank0_saved_that_step(tmp_path: Path) -> None:
    """SIGTERM to the agent while rank 0's save takes 3 s: each rank's "preempted" line comes after the save."""
    from test_resume_e2e import SLOW, finish, start

    run_dir = tmp_path / "run"
    proc, watcher = start(run_dir, 2, *SLOW, "train.max_steps=300", "train.epochs=100", "task_options.sleep=0.02",
                          "task_options.slow_state_seconds=3")  # fmt: skip
    try:
        watcher.wait_for(r"\[rank 0\] INFO step 3/", timeout=120)  # rank 1 took part in step 3's all-reduce
        proc.send_signal(signal.SIGTERM)
        assert finish(proc, watcher) != 0
    finally:
        kill_group(proc)
    text = watcher.text()
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted", text[-3000:]
    step = summary["stopped_at_step"]
    assert "slow state_dict begins" in text, text[-3000:]
    lines = [line for _, line in watcher.lines]  # in the order the workers wrote them to the shared pipe

    def first(pattern: str) -> int:
        found = [index for index, line in enumerate(lines) if re.search(pattern, line)]
        assert found, f"no line matching {pattern!r}:\n{text[-4000:]}"
        return found[0]

    saved = first(rf"\[rank 0\] INFO checkpoint saved: .*step-{step:08d}\.pt")
    for rank in (0, 1):
        left = first(rf"\[rank {rank}\] WARNING preempted: stopped at step {step} ")
        assert left > saved, (
            f"rank {rank} reported preempted before rank 0 saved step {step}:\n{''.join(lines[left : saved + 1])}"
        )
    manifest, _ = read_verified(run_dir / "checkpoints", step)  # complete: manifest, size and sha256 agree
    assert manifest.step == step


# -- 8. an orphan dies by SIGKILL, with no preemption path ------------------------------------------------------

_ORPHAN = r"""
import os, sys, time
from pathlib import Path

import torch

from service.world import orphans
from service.state.checkpoint_io import write_checkpoint
from service.world.env import detect_world
from service.telemetry.logs import configure_logging
from service.state.preemption import Preemption

orphans.ParentWatchdog.start = lambda self: self  # the watchdog off: only the parent-death signal is left
world = detect_world(os.environ)
configure_logging(world.rank)
preemption = Preemption(lambda local, every: (local, 1))  # a SIGTERM would take the preemption path
orphans.guard_against_orphaning(world)
Path(sys.argv[2]).write_text("armed")
while not preemption.requested:
    time.sleep(0.01)
write_checkpoint(Path(sys.argv[1]), 1, {"format": 1, "model": {"w": torch.ones(4)}}, "0" * 64)
print("checkpoint written after the signal", file=sys.stderr, flush=True)
sys.exit(75)
"""

_PARENT = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stderr=open(sys.argv[4], "w"))
print(child.pid, flush=True)
time.sleep(120)
"""

# A subreaper: the orphan is reparented to it, so it can read how the orphan died.
_REAPER = r"""
import ctypes, json, os, signal, subprocess, sys, time
from pathlib import Path

assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
signal.alarm(60)
parent = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
pid = int(parent.stdout.readline())
while not Path(sys.argv[4]).exists():
    time.sleep(0.01)
parent.kill()
parent.wait()
_, status = os.waitpid(pid, 0)
print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                  "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
"""


@pytest.mark.e2e
def test_an_orphan_dies_by_sigkill_without_the_watchdog_and_saves_nothing(tmp_path: Path) -> None:
    """A torchrun worker's guard with the watchdog off; its parent SIGKILLed: the kernel's SIGKILL ends it."""
    checkpoints, armed, log = tmp_path / "checkpoints", tmp_path / "armed", tmp_path / "child.log"
    env = child_env(TORCHELASTIC_RUN_ID="orphan-test", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                    LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")  # fmt: skip
    cmd = [sys.executable, "-c", _REAPER, _PARENT, _ORPHAN, str(checkpoints), str(armed), str(log)]
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=90)
        finally:
            kill_group(proc)
    assert proc.returncode == 0, output[-3000:]
    outcome = json.loads(output.strip().splitlines()[-1])
    child_log = log.read_text()
    assert outcome == {"signal": int(signal.SIGKILL), "exit": None}, (
        f"the orphan ended with {outcome}, not by SIGKILL; its log:\n{child_log[-3000:]}"
    )
    assert "SIGTERM received" not in child_log, child_log[-3000:]
    assert not checkpoints.exists() or not any(checkpoints.iterdir()), sorted(checkpoints.iterdir())
