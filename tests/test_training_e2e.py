"""Real torchrun jobs on CPU/gloo: built-in tasks, determinism, DDP and SyncBN equivalence, errors.

None of them is about how a worker starts: the jobs of 2 or 3 processes run under ``ddp-service launch`` (torchrun's
agent, its workers forked from a fork server that imported torch once: conftest.STARTS), the single-rank ones as a
world of one without a launcher."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import REPO, final_weights, read_summary, run_job

pytestmark = pytest.mark.e2e


def assert_same_weights(left: dict, right: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert torch.allclose(left[key].double(), right[key].double(), rtol=rtol, atol=atol), key


def weights_differ(left: dict, right: dict) -> bool:
    return any(not torch.allclose(left[k].double(), right[k].double(), rtol=1e-4, atol=1e-6) for k in left)


@pytest.mark.parametrize(
    ("task", "train_size", "batch", "metric", "floor"),
    # digits: 23 steps an epoch at a global batch of 64, its last step short (1437 = 22 x 64 + 29)
    [("shapes-segmentation", 256, 8, "dice", 0.5), ("digits-classification", 1437, 32, "accuracy", 0.8)],
)
def test_builtin_task_trains_under_torchrun(tmp_path, task, train_size, batch, metric, floor):
    run_dir = tmp_path / "run"
    epochs = 2
    run_job(run_dir, 2, f"task={task}", f"train.batch_size={batch}", f"train.epochs={epochs}",
            "metrics.tensorboard=true", "checkpoint.every_steps=10", "checkpoint.keep=2", start="warm")  # fmt: skip
    summary = read_summary(run_dir)
    steps_per_epoch = math.ceil(train_size / (2 * batch))  # the global batch is 2 ranks x batch
    assert summary["world_size"] == 2 and summary["restarts"] == 0
    assert summary["global_step"] == steps_per_epoch * epochs
    assert summary["epochs_completed"] == epochs
    # Every sample exactly once per epoch: no padding duplicates (DistributedSampler would add them).
    assert summary["samples_seen"] == train_size * epochs
    assert summary["status"] == "completed" and summary["resumed_from"] is None
    assert summary["eval_metric"]["name"] == metric and summary["eval_metric"]["value"] > floor
    assert summary["final_loss"] > 0 and summary["samples_per_second"] > 0
    assert len(summary["model_digest"]) == 64
    # One TensorBoard dir per rank, each with its own event file.
    for rank in (0, 1):
        assert list((run_dir / "tensorboard" / f"rank{rank}").glob("events.out.tfevents.*"))
    # Rank-0 checkpoints of the unwrapped model, the last `keep` only.
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert len(checkpoints) == 2 and checkpoints[-1].name == f"step-{summary['global_step']:08d}.pt"
    assert all(path.with_suffix(".json").is_file() for path in checkpoints)  # each with its manifest
    state = torch.load(checkpoints[-1], weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])
    assert state["loop"]["global_step"] == summary["global_step"]


STEPS20 = ("train.max_steps=20", "checkpoint.every_steps=20")


def test_ddp_two_ranks_match_one_rank_and_one_config_gives_one_digest_with_or_without_the_timing_hook(tmp_path):
    """No BatchNorm: DDP's gradient average over 2 × b is the gradient of one batch of 2b.

    The same jobs show that a run is a function of its config: the accumulating job run twice gives one model
    digest, the second time with metrics.port=auto, which registers the all-reduce timing comm hook (so the hook
    trains bit for bit like plain DDP); another seed gives another digest."""
    common = ("task=digits-classification", "task_options.batchnorm=false", *STEPS20)
    accum = (*common, "train.batch_size=2", "train.grad_accum=2")
    run_job(tmp_path / "two", 2, *common, "train.batch_size=4", start="warm")
    run_job(tmp_path / "one", 1, *common, "train.batch_size=8", start="alone")
    run_job(tmp_path / "accum", 2, *accum, "metrics.port=0", start="warm")
    run_job(tmp_path / "accum-hook", 2, *accum, "metrics.port=auto", start="warm")
    run_job(tmp_path / "one-seed1", 1, *common, "train.batch_size=8", "seed=1", start="alone")
    one = final_weights(tmp_path / "one")
    assert_same_weights(final_weights(tmp_path / "two"), one)
    # Accumulation with no_sync on all but the last micro-step keeps the same global batch.
    assert_same_weights(final_weights(tmp_path / "accum"), one)
    digest = read_summary(tmp_path / "accum")["model_digest"]
    assert read_summary(tmp_path / "accum-hook")["model_digest"] == digest
    assert read_summary(tmp_path / "one-seed1")["model_digest"] != read_summary(tmp_path / "one")["model_digest"]


def test_syncbn_two_cpu_ranks_match_one_rank_plain_batchnorm(tmp_path):
    common = ("task=shapes-segmentation", *STEPS20)
    run_job(tmp_path / "sync", 2, *common, "train.batch_size=4", start="warm")  # sync_batchnorm: auto → on
    run_job(tmp_path / "one", 1, *common, "train.batch_size=8", start="alone")  # world of 1 → plain BatchNorm
    run_job(tmp_path / "local", 2, *common, "train.batch_size=4", "train.sync_batchnorm=off", start="warm")
    one = final_weights(tmp_path / "one")
    assert_same_weights(final_weights(tmp_path / "sync"), one)
    # The control: per-rank BatchNorm statistics do drift away from the single-rank run.
    assert weights_differ(final_weights(tmp_path / "local"), one)


def test_inplace_error_is_reraised_with_the_hint(tmp_path):
    proc = run_job(tmp_path / "run", 1, "task=bad_tasks:inplace_activation", expect_ok=False, start="alone")
    assert proc.returncode != 0
    assert "modified by an inplace operation" in proc.stdout
    assert "ddp.broadcast_buffers" in proc.stdout and "InplaceGradientError" in proc.stdout


def test_a_parameter_the_loss_does_not_use_fails_naming_ddp_find_unused_parameters(tmp_path):
    """Issue 24: torch's "Expected to have finished reduction in the prior iteration" came alone; the config key
    that fixes it, and its cost, were named nowhere."""
    proc = run_job(
        tmp_path / "run", 1, "task=bad_tasks:unused_parameters", "train.max_steps=3", start="alone", expect_ok=False
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Expected to have finished reduction in the prior iteration" in proc.stdout
    assert "UnusedParametersError" in proc.stdout and "--set ddp.find_unused_parameters=true" in proc.stdout
    assert "costs time at each step" in proc.stdout


def test_task_returning_wrong_type_is_named(tmp_path):
    proc = run_job(tmp_path / "run", 1, "task=bad_tasks:not_a_task", expect_ok=False, start="alone")
    assert proc.returncode != 0 and "returned dict, not service.tasks.base.Task" in proc.stdout


def test_bring_your_own_task_from_module_function(tmp_path):
    run_dir = tmp_path / "run"
    run_job(run_dir, 2, "train.epochs=4", config=str(REPO / "examples" / "byo.yaml"), start="warm",
            PYTHONPATH=f"{REPO}:{REPO / 'examples'}")  # fmt: skip
    summary = read_summary(run_dir)
    assert summary["task"] == "my_task:build" and summary["world_size"] == 2
    assert summary["eval_metric"]["value"] > 0.6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="torch's SyncBatchNorm over NCCL needs 2 CUDA devices")
def test_syncbn_on_cuda_matches_one_rank_plain_batchnorm(tmp_path):
    common = ("task=shapes-segmentation", *STEPS20, "train.amp=off")
    run_job(tmp_path / "sync", 2, *common, "train.batch_size=4", start="warm")
    run_job(tmp_path / "one", 1, *common, "train.batch_size=8", start="alone")
    assert read_summary(tmp_path / "sync")["device"] == "cuda"
    assert_same_weights(final_weights(tmp_path / "sync"), final_weights(tmp_path / "one"), rtol=1e-4, atol=1e-5)


def test_without_launcher_dp_strategy_runs_one_process_with_a_warning(tmp_path):
    import subprocess
    import sys

    from conftest import QUICK, child_env

    run_dir = tmp_path / "run"
    args = [f"--set={item}" for item in (*QUICK, f"run_dir={run_dir}", "train.strategy=dp", "train.max_steps=4")]
    proc = subprocess.run([sys.executable, "-m", "service", "train", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.strategy=dp on CPU" in proc.stderr
    summary = read_summary(run_dir)
    assert summary["world_size"] == 1 and summary["launcher"] == "none" and summary["global_step"] == 4
