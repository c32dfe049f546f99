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
    job = (*SLOW, "train.max_steps=20", "train.epochs=10", "checkpoint.every_steps=1000", "task_options.sleep=0.04",
           "task_options.dropout=0.2", f"dist.hang_timeout_seconds={HANG_TIMEOUT}")  # fmt: skip
    run_job(tmp_path / "straight", 2, *job)
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
    proc, watcher = start(run_dir, 2, *SLOW, "train.max_steps=200", "train.epochs=100", "task_options.sleep=0.04",
                          launcher=("--standalone", "--max-restarts=0"))  # fmt: skip
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
