"""Issue 17, part 2 under real torchrun (2 CPU processes): fp16's scaler and train.compile resume exactly.

An interrupted run is its step-4 (or step-6) checkpoint copied alone into a fresh run_dir: what a rerun after a
kill past that save finds (the kill and restart paths themselves are test_resume_e2e's). The jobs run under
``ddp-service launch`` (workers forked from its fork server: conftest.STARTS), the start being no part of this.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import read_summary, run_job

pytestmark = pytest.mark.e2e

STEPS = ("train.max_steps=8", "train.epochs=10", "checkpoint.every_steps=2", "train.log_every=2")
HUGE = ("task=amp_tasks:huge_loss_at", "task_options.position=[32,64]", "train.amp=fp16", *STEPS)  # steps 3 and 5
# aot_eager: dynamo and AOTAutograd as with inductor, without its code generation (a minute of gcc on 2 cores).
COMPILED = "train.compile=aot_eager"
SCALER_AT_8 = {"scale": 16384.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
               "_growth_tracker": 3}  # back-offs at steps 3 and 5, then steps 6-8 without overflow  # fmt: skip


def interrupted_at(step: int, source: Path, target: Path) -> Path:
    """A run_dir holding only ``source``'s checkpoint of ``step``: what a rerun after a kill past that save finds."""
    (target / "checkpoints").mkdir(parents=True)
    for suffix in ("pt", "json"):
        shutil.copy2(source / "checkpoints" / f"step-{step:08d}.{suffix}", target / "checkpoints")
    return target


def checkpoint(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)


def test_fp16_overflow_skips_and_compiled_and_eager_runs_resume_from_each_other_exactly(tmp_path):
    """fp16, eager 0-8 (the scaler skips steps 3 and 5) | compiled from its step 4 (skips step 5 again, compiled) |
    eager from that one's step 6.

    All three end on the same weights and scaler state: the scaler's state is checkpointed and restored (the
    compiled run lowers the scale it restored at step 4, 32768, at step 5; the last run goes on from the 16384 and
    the growth count of step 6), and checkpoints of compiled and eager runs are interchangeable, both ways. One run
    of the three is compiled: its step 4 is after one back-off and before the next, so the restore and an overflow
    skip are both under compile. aot_eager runs eager's ATen kernels, so the weights match bit for bit; inductor
    fuses and reorders float math (last-bit differences).
    """
    straight = tmp_path / "eager"
    done = run_job(straight, 2, *HUGE, start="warm")
    summary = read_summary(straight)
    assert summary["status"] == "completed" and summary["nonfinite_steps"] == 2, done.stdout[-3000:]
    assert "step 3: the gradient norm is" in done.stdout and "lowers its scale from 65536 to 32768" in done.stdout
    assert "step 5: the gradient norm is" in done.stdout and "lowers its scale from 32768 to 16384" in done.stdout
    assert checkpoint(straight, 8)["scaler"] == SCALER_AT_8

    compiled = interrupted_at(4, straight, tmp_path / "compiled-from-eager")
    # nonfinite: stop (the default); a scaler skip does not trip it, compiled either
    done = run_job(compiled, 2, *HUGE, COMPILED, start="warm")
    assert "train.compile: aot_eager backend" in done.stdout
    assert "step 5: the gradient norm is" in done.stdout, done.stdout[-3000:]
    assert "lowers its scale from 32768 to 16384 (1 skipped so far)" in done.stdout  # the restored scale
    keys = list(checkpoint(compiled, 8)["model"])
    assert keys == ["linear.weight", "linear.bias"]  # no _orig_mod. or module. prefix
    eager = interrupted_at(6, compiled, tmp_path / "eager-from-compiled")
    run_job(eager, 2, *HUGE, start="warm")
    for run_dir, step, skipped in ((compiled, 4, 1), (eager, 6, 0)):
        resumed = read_summary(run_dir)
        assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == step, run_dir.name
        assert resumed["nonfinite_steps"] == skipped  # step 5's skip, under compile; none after step 6
        assert resumed["model_digest"] == summary["model_digest"], run_dir.name
        assert checkpoint(run_dir, 8)["scaler"] == SCALER_AT_8


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_the_builtin_task_with_batchnorm_trains_at_two_processes_under_amp(tmp_path, amp):
    """#24.1: the demo's task (a UNet with BatchNorm, SyncBatchNorm at 2 processes) under train.amp=bf16/fp16.

    The CPU SyncBatchNorm updated its float32 running statistics from half-precision batch means and failed
    ("expected dtype float for `end`") at the first step; its statistics are now taken in float32.
    """
    run_dir = tmp_path / amp
    done = run_job(run_dir, 2, "task=shapes-segmentation", f"train.amp={amp}", "train.max_steps=3",
                   "train.batch_size=4", "train.log_every=1", start="warm")  # fmt: skip
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["global_step"] == 3, done.stdout[-3000:]
    weights = checkpoint(run_dir, 3)["model"]
    running = [value for key, value in weights.items() if key.endswith("running_mean")]
    assert running and all(value.dtype == torch.float32 and torch.isfinite(value).all() for value in running)
