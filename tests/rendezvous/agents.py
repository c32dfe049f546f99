"""Real torchrun agents for the end-to-end tests (and the benchmark).

Each agent is ``python -m torch.distributed.run`` in its own session, with its
output in a file; every wait is bounded and ``kill`` takes the whole group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from procs import kill_tree

STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank (\d+)\].*\bstep (\d+)\b", re.M)


def train_args(run_dir: Path, max_steps: int, *extra: str) -> list[str]:
    """The foundation's worker command, tiny and fast."""
    return [
        "-m", "service", "train",
        "--set", f"run_dir={run_dir}",
        "--set", f"train.max_steps={max_steps}",
        "--set", "train.epochs=1000",
        "--set", "train.log_every=1",
        *extra,
    ]


_GATED = """
import os, sys, time
from torch.distributed import run
gate = sys.argv[1]
print("gated agent ready", flush=True)
deadline = time.monotonic() + 300
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.argv = ["torchrun", *sys.argv[2:]]
run.main(sys.argv[1:])
"""


class Agent:
    """One torchrun agent ("node") on its own loopback address."""

    def __init__(
        self,
        log_path: Path,
        local_addr: str,
        backend: str,
        endpoint: str,
        run_id: str,
        nnodes: str,
        nproc: int,
        script: list[str],
        max_restarts: int = 3,
        rdzv_conf: str = "",
        env: dict[str, str] | None = None,
        gate: Path | None = None,
    ) -> None:
        self.log_path = log_path
        self.local_addr = local_addr
        # A gated agent imports torch first and starts torchrun only once ``gate`` exists,
        # so a test can add a node at a precise moment without paying for interpreter start-up.
        launcher = ["-c", _GATED, str(gate)] if gate is not None else ["-m", "torch.distributed.run"]
        args = [
            sys.executable, *launcher,
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--local-addr={local_addr}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
        ]
        if rdzv_conf:
            args.append(f"--rdzv-conf={rdzv_conf}")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO", **(env or {}))
        self.started = time.time()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args + script, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit code; on timeout the agent is killed and ``AssertionError`` raised."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"The agent on {self.local_addr} ran past {timeout} s:\n{self.log()[-4000:]}")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Wait for a regex in the log; fail if the agent exits or the time runs out."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            match = regex.search(self.log())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"No /{pattern}/ from the agent on {self.local_addr}:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL the agent and its workers; torchrun starts workers in sessions of their own."""
        kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def step_times(self, after: re.Pattern | None = None) -> list[tuple[float, int, int]]:
        """(epoch time, rank, step) of each training-step line, optionally only after the last ``after``."""
        text = self.log()
        if after is not None:
            marks = list(after.finditer(text))
            text = text[marks[-1].end():] if marks else ""
        return [
            (datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(rank), int(step))
            for ts, rank, step in STEP_LINE.findall(text)
        ]


# torchrun reports the failed worker group (at WARNING/ERROR, so always printed) before it restarts it.
RESTART_MARK = re.compile(r"failed \(exitcode|closing signal SIG")


def recovery_seconds(agent: Agent, killed_at: float) -> float | None:
    """Seconds from a kill to the first training step of the group the agent restarted afterwards."""
    later = [t for t, _, _ in agent.step_times(after=RESTART_MARK) if t > killed_at]
    return min(later) - killed_at if later else None
