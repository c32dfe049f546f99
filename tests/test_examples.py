"""The three ported examples (examples/*.yaml) under real torchrun at 2 processes, each through a preemption.

Each example runs its own YAML twice at once: straight through, and under a
torchrun agent allowed one restart (mnist's under plain torchrun, the others' under
``ddp-service launch``: PREEMPTED_START), whose rank-1 worker gets SIGTERM at step 3
(a preemption notice reaching one process; it sends it itself, through
tests/tasks/example_signal.py, because a test that reads the log and then
signals can lag the whole of a 40-step run of 25 ms steps on a loaded machine). Every rank stops at the
same step, rank 0 checkpoints it, the workers exit 75 (preempted), and the
agent starts them again: the same command, resumed from that checkpoint. It
must finish with the straight run's ``model_digest``: the task's own step,
collate, optimizer, scheduler and eval survive a stop mid-run bit for bit.
One agent for both attempts keeps each example to two torchrun starts.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, child_env, kill_group, read_summary, torchrun_cmd

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"
# What each example's straight run must reach in its 40 steps (chance: 0.1, about 1/45 and 1/24).
LEARNS = {"mnist": ("accuracy", 0.3), "nanogpt": ("accuracy", 0.15), "word_lm": ("accuracy", 0.5)}
# Each example's task, and the samples one rank fetches per optimizer step (batch_size x grad_accum).
TASKS = {"mnist": ("mnist_cnn:build", 8), "nanogpt": ("nanogpt_char:build", 16), "word_lm": ("word_lm:build", 8)}
# How each example's preempted run starts (conftest.STARTS): one under plain torchrun, its workers and their
# restart cold (new interpreters), as its users run it; the other two under ``ddp-service launch`` (the same torchrun
# agent and restart, the workers forked), as every reference run, the example's own step being what they test.
PREEMPTED_START = {"mnist": "cold", "nanogpt": "warm", "word_lm": "warm"}


def start(run_dir, name: str, *launcher: str, overrides: tuple[str, ...] = (), how: str = "cold") -> subprocess.Popen:
    # log_every may change between starts; 1: a line for every step. how: conftest.STARTS
    cmd = torchrun_cmd(2, f"run_dir={run_dir}", "train.log_every=1", *overrides, config=str(EXAMPLES / f"{name}.yaml"),
                       launcher=("--standalone", *launcher), start=how)  # fmt: skip
    env = child_env(PYTHONUNBUFFERED="1", PYTHONPATH=f"{REPO}:{EXAMPLES}:{REPO / 'tests' / 'tasks'}")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def signalled_at(step: int, name: str) -> tuple[str, ...]:
    """The example's own task, whose rank 1 sends itself SIGTERM while fetching step ``step`` (first attempt)."""
    task, per_step = TASKS[name]
    return ("task=example_signal:build", f"task_options.example={task}", f"task_options.signal_step={step}",
            f"task_options.samples_per_rank_step={per_step}")  # fmt: skip


def finished(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
        return output
    finally:
        kill_group(proc)


@pytest.mark.parametrize("name", ["mnist", "nanogpt", "word_lm"])
def test_example_trains_and_a_preempted_run_resumes_to_the_same_weights(tmp_path, name):
    straight = start(tmp_path / "straight", name, how="warm")  # the reference
    run = start(tmp_path / "run", name, "--max-restarts=1", overrides=signalled_at(3, name), how=PREEMPTED_START[name])
    output = finished(run)
    straight_out = finished(straight)
    assert straight.returncode == 0, straight_out[-4000:]
    reference = read_summary(tmp_path / "straight")
    assert reference["status"] == "completed" and reference["world_size"] == 2 and reference["global_step"] == 40

    assert run.returncode == 0, output[-4000:]
    # Any rank's line: the agent stops the other workers as soon as the first one exits 75, so rank 0 may be
    # stopped in its teardown before it logs (its checkpoint and summary are written by then).
    stopped = re.search(r"\[rank \d\] WARNING preempted: stopped at step (\d+)", output)
    assert stopped, output[:3000] + "\n...\n" + output[-3000:]
    step = int(stopped.group(1))
    assert 3 <= step < 40  # mid-run: every rank stopped at the step the signal reached them
    assert re.search(r"(?i)exitcode\W+75", output), output[-4000:]  # the agent saw "preempted", and restarted
    assert re.search(rf"resuming from \S*step-{step:08d}\.pt", output), output[-4000:]
    resumed = read_summary(tmp_path / "run")
    assert resumed["status"] == "completed" and resumed["restarts"] == 1
    assert resumed["resumed_from"]["step"] == step
    assert (resumed["global_step"], resumed["samples_seen"]) == (reference["global_step"], reference["samples_seen"])
    assert resumed["model_digest"] == reference["model_digest"]
    assert resumed["eval_metrics"] == reference["eval_metrics"]

    metric, floor = LEARNS[name]
    assert set(reference["eval_metrics"]) == {"loss", metric}
    assert reference["eval_metric"]["name"] == metric and reference["eval_metric"]["value"] > floor, reference


CLM = EXAMPLES / "clm_no_trainer.py"


def clm_corpus(tmp_path, monkeypatch) -> Path:
    """100 lines of 5-15 words of a 40-word vocabulary; the datasets cache this test's own, offline."""
    import random

    rng = random.Random(35)
    words = [f"w{index}" for index in range(40)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + "\n"
                              for _ in range(100)))  # fmt: skip
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return corpus


def test_the_clm_no_trainer_port_resumes_a_preempted_run_to_the_uninterrupted_digest(tmp_path, monkeypatch):
    """examples/clm_no_trainer.py (transformers' run_clm_no_trainer.py structure on a session): a tiny GPT-2 and a
    local word-level tokenizer on a local text file, 3 epochs through s.epochs(--num_train_epochs) at 2 processes;
    rank 1 gets SIGTERM at epoch 1's first step, and the rerun resumes after it to the uninterrupted run's digest,
    with the same evaluation (its perplexity per epoch, world-summed over s.eval_batches). Three epochs, as in the
    streaming variant: the stop agreement after a signal may come only at epoch 1's evaluation, never past the end."""
    from test_session_e2e import run_script, signalled_then_rerun

    corpus = clm_corpus(tmp_path, monkeypatch)
    args = ("--train_file", str(corpus), "--block_size", "16", "--per_device_train_batch_size", "4",
            "--num_train_epochs", "3")  # fmt: skip
    sets = ("train.log_every=1",)
    output = run_script(CLM, 2, tmp_path / "straight", sets, args, str(REPO))
    straight = read_summary(tmp_path / "straight")
    assert (straight["status"], straight["epochs_completed"]) == ("completed", 3), output[-3000:]
    per_epoch = straight["global_step"] // 3
    assert per_epoch >= 4 and output.count("epoch 1: perplexity") == 1  # s.print: rank 0's line
    assert set(straight["eval_metrics"]) == {"perplexity", "eval_loss"}

    at = per_epoch + 1  # epoch 1's first step
    stopped, resumed, output = signalled_then_rerun(CLM, tmp_path / "run", sets, args, at, monkeypatch, str(REPO))
    assert per_epoch < stopped["stopped_at_step"] <= 2 * per_epoch, stopped  # in epoch 1, or at its end
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == stopped["stopped_at_step"]
    assert "epoch 0: perplexity" not in output and output.count("epoch 2: perplexity") == 1  # resumed after epoch 0
    assert resumed["model_digest"] == straight["model_digest"], output[-4000:]
    assert resumed["eval_metrics"] == straight["eval_metrics"]


def test_the_clm_no_trainer_ports_streaming_variant_trains_every_block_and_resumes_to_its_digest(tmp_path,
                                                                                             monkeypatch):  # fmt: skip
    """examples/clm_no_trainer.py --streaming: the train file as a ``datasets`` stream (the whole file, tokenized and
    grouped into blocks of 16 as it is read), one block in every 2 to each rank (``split_dataset_by_node`` of a
    one-file stream), 4 a batch: each of s.epochs(3) takes the steps of the rank with fewer blocks, and no more
    (train.max_steps only bounds the stream); rank 1 gets SIGTERM at epoch 1's first step, and the rerun goes on
    in the stream to the uninterrupted run's digest and evaluation. Three epochs, not two: steps of ~15 ms put the
    next stop agreement after a signal up to ~0.1 s (7-9 steps) later, and the agreement after epoch 1's evaluation
    at the latest, so the stop lands in epoch 1 or at its end and never after the run's last step."""
    from test_session_e2e import run_script, signalled_then_rerun

    corpus = clm_corpus(tmp_path, monkeypatch)
    tokens = sum(len(line.split()) + 1 for line in corpus.read_text().splitlines())  # each line's words, <eos>
    blocks = tokens // 16  # group_texts over the stream's one batch of 1,000 lines: the remainder dropped
    per_epoch = blocks // 2 // 4  # rank 1's blocks (the fewer) in whole batches of 4
    args = ("--train_file", str(corpus), "--block_size", "16", "--per_device_train_batch_size", "4",
            "--num_train_epochs", "3", "--streaming")  # fmt: skip
    sets = ("train.log_every=1", "train.max_steps=1000")
    output = run_script(CLM, 2, tmp_path / "straight", sets, args, str(REPO), start="warm")
    straight = read_summary(tmp_path / "straight")
    assert (straight["status"], straight["epochs_completed"]) == ("completed", 3), output[-3000:]
    assert per_epoch >= 4 and straight["global_step"] == 3 * per_epoch, (blocks, straight["global_step"])
    assert straight["samples_seen"] == 3 * per_epoch * 8 and straight["dropped_batches"] == 3 * (
        (blocks + 1) // 2 // 4 - per_epoch
    )  # rank 0's extra batch, when it has one, each epoch
    assert output.count("epoch 1: perplexity") == 1 and set(straight["eval_metrics"]) == {"perplexity", "eval_loss"}

    stopped, resumed, output = signalled_then_rerun(CLM, tmp_path / "run", sets, args, per_epoch + 1, monkeypatch,
                                                    str(REPO))  # fmt: skip
    assert per_epoch < stopped["stopped_at_step"] <= 2 * per_epoch, stopped  # in epoch 1, or at its end
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == stopped["stopped_at_step"]
    assert "epoch 0: perplexity" not in output and output.count("epoch 2: perplexity") == 1  # resumed after epoch 0
    assert resumed["global_step"] == straight["global_step"]
    assert resumed["model_digest"] == straight["model_digest"], output[-4000:]
    assert resumed["eval_metrics"] == straight["eval_metrics"]
