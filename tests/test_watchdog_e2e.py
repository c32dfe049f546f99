"""The hang watchdog under real torchrun on CPU: a SIGSTOPped rank, and a SIGTERM while stuck in a collective.

A SIGSTOPped rank keeps its sockets open, so the other rank's gloo collective
waits the whole process-group timeout (300 s) instead of failing, and a
SIGTERM to it is only a flag that the main thread, blocked in C++, never
reaches: torchrun waits out its 30 s ``--shutdown-timeout`` before SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import kill_group, read_summary, run_job
from procs import worker_pids
from test_resume_e2e import SLOW, finish, start

pytestmark = pytest.mark.e2e

HANG_TIMEOUT = 5


def gone(pid: int) -> bool:
    """The process exited (a zombie its agent has not reaped yet counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_gone(pid: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} still runs after {timeout} s")


def test_a_sigstopped_rank_is_named_the_world_restarts_and_ends_bit_exact(tmp_path):
    """Issue 18, test 5c: rank 1 SIGSTOPped past dist.hang_timeout_seconds; rank 0's watchdog names it, dumps its
    stacks and exits 1; torchrun restarts the world, which resumes from the in-memory snapshot of the last step
    (no disk checkpoint but the end: every_steps=1000) and ends with the digest of an uninterrupted run. Before the
    watchdog, rank 0 waited the 300 s process-group timeout."""
    # A snapshot every step: checkpoint.snapshot_every=auto takes the tiny task's every few steps on a loaded CPU.
    job = (*SLOW, "train.max_steps=20", "train.epochs=10", "checkpoint.every_steps=1000", "task_options.sleep=0.04",
           "task_options.dropout=0.2", f"dist.hang_timeout_seconds={HANG_TIMEOUT}",
           "checkpoint.snapshot_every=1")  # fmt: skip
    run_job(tmp_path / "straight", 2, *job, start="warm")  # the reference; the hung run's restart is cold
    straight = read_summary(tmp_path / "straight")

    run_dir = tmp_path / "hung"
    proc, watcher = start(run_dir, 2, *job, launcher=("--standalone", "--max-restarts=1"))
    try:
        watcher.wait_for(r"\[rank 0\] INFO step 9/", timeout=120)
        victims = worker_pids(proc.pid)
        stopped_at = time.monotonic()
        os.kill(victims[1], signal.SIGSTOP)
        completed = max(int(step) for step in re.findall(r"\[rank 0\] INFO step (\d+)/", watcher.text()))
        try:
            found = watcher.wait_for(r"\[rank 0\] ERROR hang: .*rank\(s\) 1 behind", timeout=HANG_TIMEOUT + 20,
                                     after=stopped_at)  # fmt: skip
        finally:
            os.kill(victims[1], signal.SIGCONT)  # it finds its peer gone and leaves; torchrun restarts both
        watcher.wait_for(r"process group up: attempt 1", timeout=60, after=found)
        assert finish(proc, watcher) == 0, watcher.text()[-4000:]
    finally:
        kill_group(proc)
    text = watcher.text()
    assert HANG_TIMEOUT <= found - stopped_at < HANG_TIMEOUT + 5, text[-4000:]
    assert "rank 1: " in text and "silent for" in text  # every rank's last step and phase, the stopped one silent
    assert "most recent call first" in text  # faulthandler's stacks
    summary = read_summary(run_dir)
    assert (summary["status"], summary["restarts"]) == ("completed", 1)
    resumed = summary["resumed_from"]
    assert resumed["source"] == "snapshot" and completed - 1 <= resumed["step"] <= completed + 1, (resumed, completed)
    assert summary["model_digest"] == straight["model_digest"]
    from service.telemetry.hangs import read_hangs

    assert [(hang["rank"], hang["behind"]) for hang in read_hangs(run_dir / "hangs.jsonl")] == [(0, [1])]


def test_a_survivor_signalled_while_stuck_in_a_collective_leaves_in_seconds(tmp_path):
    """Issue 18, item 3: rank 1 SIGSTOPped, then SIGTERM to rank 0 (as torchrun sends it when tearing a group
    down). Rank 0's main thread is blocked in gloo and never runs its handler; the watchdog sees the signal
    through the wakeup fd, finds rank 1 silent, and exits within seconds instead of the 30 s shutdown timeout."""
    run_dir = tmp_path / "run"
    # Warm (ddp-service launch: the same torchrun agent, its workers forked): what is tested is the worker's watchdog.
    proc, watcher = start(run_dir, 2, *SLOW, "train.max_steps=200", "train.epochs=100", "task_options.sleep=0.04",
                          launcher=("--standalone", "--max-restarts=0"), start="warm")  # fmt: skip
    try:
        watcher.wait_for(r"\[rank 0\] INFO step 6/", timeout=120)
        victims = worker_pids(proc.pid)
        os.kill(victims[1], signal.SIGSTOP)
        try:
            time.sleep(1.0)  # rank 0 now waits in a collective on rank 1
            signalled = time.monotonic()
            os.kill(victims[0], signal.SIGTERM)
            left = wait_gone(victims[0], timeout=25)
        finally:
            os.kill(victims[1], signal.SIGCONT)
        assert finish(proc, watcher, timeout=60) != 0
    finally:
        kill_group(proc)
    text = watcher.text()
    assert "[rank 0] ERROR stuck after a stop signal" in text and "rank(s) 1 silent" in text, text[-4000:]
    print(f"teardown: rank 0 left {left - signalled:.1f} s after its SIGTERM")
    assert left - signalled < 6, text[-4000:]
    assert f"Unable to shutdown process {victims[0]}" not in text


def test_a_rank_looping_in_its_forward_is_named_alone_and_a_last_attempt_leaves_no_snapshots(tmp_path):
    """#24.8 and #24.7: rank 1 stays in its own forward (a 600 s sleep at its 6th training forward) while rank 0
    waits in DDP's gradient all-reduce. Both were "in forward_backward" at the same step, and the report named
    "rank(s) 0, 1 behind"; forward and backward are phases of their own now, and rank 1 alone is named. With no
    restart left (--max-restarts=0), the watchdog's exit (os._exit, past the loop's clean-up) removes the node's
    in-memory snapshots: nothing would read them."""
    shm = tmp_path / "shm"
    # Cold: under ddp-service launch the agent removes the node's snapshots at its end, which would hide a worker
    # that leaves them behind.
    done = run_job(tmp_path / "run", 2, *SLOW, "train.max_steps=50", "train.epochs=10", "task_options.sleep=0.02",
                   "task_options.long_step_at=6", "task_options.long_step_seconds=600",
                   "task_options.long_step_ranks=[1]", f"dist.hang_timeout_seconds={HANG_TIMEOUT}",
                   f"checkpoint.snapshot_dir={shm}",
                   timeout=120, expect_ok=False)  # fmt: skip
    text = done.stdout
    assert done.returncode != 0, text[-4000:]
    reports = re.findall(r"\[rank (\d)\] ERROR hang: .*?: (rank\(s\) [\d, ]+ behind|no rank behind the others)", text)
    assert reports and all(named == "rank(s) 1 behind" for _, named in reports), (reports, text[-4000:])
    # Rank 0 waits in the first SyncBatchNorm all-reduce of its forward (a collective entered), rank 1 never got there.
    assert "rank 1: 5 steps done, in forward," in text and "rank 0: 5 steps done, in forward" in text, text[-4000:]
    assert list((shm / f"ddp-service-{os.getuid()}").iterdir()) == [], "the snapshots outlived the job"


def test_a_one_off_data_stall_is_reported_not_a_hang(tmp_path):
    """#24.13: one 8 s stall in rank 1's data loading (its loader alive: it is reading a sample), past the 5 s hang
    timeout: reported (rank, phase, seconds) and waited for, by the stalled rank and by its peer, up to
    dist.data_timeout_seconds; the job completes. It used to kill a healthy job."""
    done = run_job(tmp_path / "run", 2, *SLOW, "train.max_steps=12", "train.epochs=10", "task_options.sleep=0.02",
                   "train.batch_size=4", "task_options.stall_at=30", "task_options.stall_seconds=8",
                   f"dist.hang_timeout_seconds={HANG_TIMEOUT}", timeout=150, expect_ok=False, start="warm")  # fmt: skip
    text = done.stdout
    assert done.returncode == 0 and read_summary(tmp_path / "run")["status"] == "completed", text[-4000:]
    assert "data stall begins" in text and "ERROR hang" not in text
    assert re.search(r"\[rank 1\] WARNING rank 1 has waited \d+\.\d s for its data \(in data after step \d+\)", text)
    assert re.search(r"\[rank 0\] WARNING no progress for \d+\.\d s, but rank\(s\) 1 waiting for their data", text)


def test_a_slow_compilation_of_the_evaluation_is_progress_not_a_hang(tmp_path):
    """#24.12: the first evaluation compiles its graph (8 s here, a cold inductor cache in the report) long after the
    steps set a 5 s hang timeout; compiling is bounded by the start-up bound (dist.timeout_seconds), on the rank and
    as its peers see it. It used to be killed as "hang … (in eval after step N)". (Issue 36: the task slowed the
    settle step's no_grad graph at step 0, under the start-up bound, so this passed while no compilation counted:
    dynamo's callbacks were registered only if it was loaded before the watchdog started, and it never is.)"""
    done = run_job(tmp_path / "run", 2, "task=compile_tasks:slow_eval_compile", "task_options.image_size=16",
                   "task_options.eval_compile_seconds=8", "train.max_steps=8", "train.eval_every=4",
                   "train.epochs=10", "train.log_every=1", f"dist.hang_timeout_seconds={HANG_TIMEOUT}",
                   timeout=180, expect_ok=False)  # fmt: skip
    text = done.stdout
    assert "slow eval compilation begins" in text, text[-4000:]
    assert done.returncode == 0 and read_summary(tmp_path / "run")["status"] == "completed", text[-4000:]
    assert "ERROR hang" not in text
