"""A lost worker under torchrun's shared agent store: the restarted group must train again.

Without a per-attempt store prefix, the restarted workers read the previous
attempt's gloo addresses ("Gloo connectFullMesh failed ... Connection refused")
and the job burns its only restart and fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import REPO, child_env, kill_group, read_summary, torchrun_cmd
from procs import worker_pids

pytestmark = pytest.mark.e2e


class LineWatcher:
    """Collects a child's output lines with their arrival times, in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> float:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, line in list(self.lines):
                if stamp >= after and regex.search(line):
                    return stamp
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def test_killed_worker_is_restarted_and_training_resumes(tmp_path):
    run_dir = tmp_path / "run"
    max_steps = 60
    cmd = torchrun_cmd(2, f"run_dir={run_dir}", f"train.max_steps={max_steps}", "train.epochs=10", "train.log_every=1",
                       launcher=("--standalone", "--max-restarts=1"))  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        watcher = LineWatcher(proc)
        watcher.wait_for(r"\[rank 1\] INFO step 5/", timeout=90)
        victims = worker_pids(proc.pid)
        assert set(victims) == {0, 1}, victims
        killed_at = time.monotonic()
        os.kill(victims[1], signal.SIGKILL)
        restarted = watcher.wait_for(r"process group up: attempt 1", timeout=60, after=killed_at)
        first_step = watcher.wait_for(r"\[rank \d\] INFO step 1/", timeout=60, after=restarted)
        assert proc.wait(timeout=120) == 0, watcher.text()[-4000:]
    finally:
        kill_group(proc)
    summary = read_summary(run_dir)
    assert summary["restarts"] == 1 and summary["world_size"] == 2
    assert summary["global_step"] == max_steps
    assert "connectFullMesh" not in watcher.text()
    recovery = first_step - killed_at
    print(f"recovery: {recovery:.1f} s from SIGKILL to the restarted group's first step")
    assert recovery < 30
