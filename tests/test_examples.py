"""The three ported examples (examples/*.yaml) under real torchrun at 2 processes, each through a preemption.

Each example runs its own YAML twice at once: straight through, and with its
torchrun agent sent SIGTERM a few steps in (as a scheduler preempts a job);
then the preempted run is started again with the same command. The rerun must
finish with the straight run's ``model_digest``: the task's own step, collate,
optimizer, scheduler and eval survive a stop mid-epoch bit for bit.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
from conftest import REPO, child_env, kill_group, read_summary, run_job, torchrun_cmd

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"
ENV = {"PYTHONPATH": f"{REPO}:{EXAMPLES}"}
# What each example's straight run must reach in its 40 steps (chance: 0.1, 1/45 and 1/24).
LEARNS = {"mnist": ("accuracy", 0.3), "nanogpt": ("accuracy", 0.15), "word_lm": ("accuracy", 0.5)}


def start(run_dir, config: str, *overrides: str) -> subprocess.Popen:
    cmd = torchrun_cmd(2, f"run_dir={run_dir}", *overrides, config=config)
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(PYTHONUNBUFFERED="1", **ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def preempt_at(proc: subprocess.Popen, step: int, timeout: float = 120) -> str:
    """SIGTERM the agent the moment rank 0 logs ``step``; return the whole output once the job has stopped.

    The line is read from the pipe as it comes (no polling), so the signal lands
    within a step or two, long before the job's end.
    """
    output = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if f"[rank 0] INFO step {step}/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=timeout)
        return "".join(output) + rest
    finally:
        kill_group(proc)


@pytest.mark.parametrize("name", ["mnist", "nanogpt", "word_lm"])
def test_example_trains_and_a_preempted_run_resumes_to_the_same_weights(tmp_path, name):
    config = str(EXAMPLES / f"{name}.yaml")
    quick = ("train.log_every=1",)  # log_every may change between starts; 1: a line to signal at, every step
    straight = start(tmp_path / "straight", config, *quick)
    preempted = start(tmp_path / "run", config, *quick)
    output = preempt_at(preempted, 3)
    try:
        straight_out, _ = straight.communicate(timeout=120)
    finally:
        kill_group(straight)
    assert straight.returncode == 0, straight_out[-4000:]
    reference = read_summary(tmp_path / "straight")
    assert reference["status"] == "completed" and reference["world_size"] == 2 and reference["global_step"] == 40

    stopped = read_summary(tmp_path / "run")
    assert preempted.returncode != 0 and stopped["status"] == "preempted", output[-4000:]
    assert 3 <= stopped["stopped_at_step"] < 40, stopped  # mid-run: the signal lands within a few steps

    run_job(tmp_path / "run", 2, *quick, config=config, **ENV)
    resumed = read_summary(tmp_path / "run")
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == stopped["stopped_at_step"]
    assert (resumed["global_step"], resumed["samples_seen"]) == (reference["global_step"], reference["samples_seen"])
    assert resumed["model_digest"] == reference["model_digest"]
    assert resumed["eval_metrics"] == reference["eval_metrics"]

    metric, floor = LEARNS[name]
    assert set(reference["eval_metrics"]) == {"loss", metric}
    assert reference["eval_metric"]["name"] == metric and reference["eval_metric"]["value"] > floor, reference
