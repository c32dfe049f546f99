"""Real torchrun agents for the end-to-end tests (and the benchmark).

Each agent is ``python -m torch.distributed.run`` in its own session, with its
output in a file; every wait is bounded and ``kill`` takes the whole group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from procs import kill_tree

REPO = Path(__file__).resolve().parents[2]
# The service and the test tasks (tests/tasks: slow_tasks, probe_tasks, ...) importable in every agent and worker.
PYTHONPATH = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests" / "tasks"), os.environ.get("PYTHONPATH", "")]))

_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
# A training step: the service's "step 5/30 epoch 0 loss ..." or bench/rendezvous.py's "step 5". Not the
# other lines that name a step ("resuming from ... (step 5", "eval epoch 0 step 8", "preempted: ... step 5").
STEP_LINE = re.compile(rf"^{_TIME} \[rank (\d+)\] (?:INFO )?step (\d+)\b", re.M)
# service/state/resume.py, on every rank that resumes: "resuming from <file> (step N, ...)".
RESUME_LINE = re.compile(r"\[rank (\d+)\] INFO resuming from (\S+) \(step (\d+),")
# service/cli.py, on every rank of a preempted world: "preempted: stopped at step N after saving ...".
PREEMPTED_LINE = re.compile(r"\[rank (\d+)\] WARNING preempted: stopped at step (\d+)\b")
# service/state/checkpoint.py, rank 0: "checkpoint saved: <dir>/step-0000000N.pt (...)".
SAVED_LINE = re.compile(r"\[rank 0\] INFO checkpoint saved: \S*step-(\d{8})\.pt")


def train_args(run_dir: Path, max_steps: int, *extra: str) -> list[str]:
    """The foundation's worker command, tiny and fast."""
    return [
        "-m",
        "service",
        "train",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        f"train.max_steps={max_steps}",
        "--set",
        "train.epochs=1000",
        "--set",
        "train.log_every=1",
        # One line per record: tqdm's carriage returns would glue the bar to the next log line.
        "--set",
        "train.progress_bar=false",
        "--set",
        "metrics.tensorboard=false",
        # Every rank's INFO lines (rank 0 alone logs them otherwise): the tests follow each node's own ranks.
        "--set",
        "logging.all_ranks=true",
        *extra,
    ]


# An agent that does its imports, then waits for the gate file before it starts: ``{imports}`` and ``{run}``
# make it torchrun's agent, or (warm) `ddp-service launch`'s, whose fork server starts after the gate and imports
# torch while the agent rendezvouses; its worker command is the one `python -m service launch` gives torchrun, so
# it joins the same job (its identity).
_GATE = """
import os, sys, time
{imports}
gate = sys.argv[1]
print("gated agent ready", flush=True)
deadline = time.monotonic() + 300
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.02)
{run}
"""
_GATED = _GATE.format(imports="from torch.distributed import run",
                      run='sys.argv = ["torchrun", *sys.argv[2:]]\nrun.main(sys.argv[1:])')  # fmt: skip
_GATED_WARM = _GATE.format(
    imports="import torch.distributed.run\nimport service.cli, service.ops.launcher",
    run='sys.argv = ["ddp-service", "launch", *sys.argv[2:]]\nfrom service.entry import main\nmain()',
)


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
        warm: bool = False,
    ) -> None:
        self.log_path = log_path
        self.local_addr = local_addr
        # A gated agent imports torch first and starts torchrun only once ``gate`` exists,
        # so a test can add a node at a precise moment without paying for interpreter start-up.
        launcher = ["-c", _GATED, str(gate)] if gate is not None else ["-m", "torch.distributed.run"]
        if warm:  # `ddp-service launch`: the same agent, its workers forked from a preloaded fork server
            launcher, script = (
                ["-c", _GATED_WARM, str(gate)] if gate is not None else ["-m", "service", "launch"],
                script[3:] if script[:3] == ["-m", "service", "train"] else script,
            )
        args = [
            sys.executable,
            *launcher,
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--local-addr={local_addr}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
        ]
        if rdzv_conf:
            args.append(f"--rdzv-conf={rdzv_conf}")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO", PYTHONPATH=PYTHONPATH)
        full_env.update(env or {})
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
            raise AssertionError(
                f"The agent on {self.local_addr} ran past {timeout} s:\n{self.log()[-4000:]}"
            ) from None

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

    def sigterm(self) -> None:
        """SIGTERM the agent alone, as a node's shutdown or a scheduler's preemption does."""
        os.kill(self.proc.pid, signal.SIGTERM)

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
            text = text[marks[-1].end() :] if marks else ""
        return [
            (datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(rank), int(step))
            for ts, rank, step in STEP_LINE.findall(text)
        ]


def rank_steps(agents: list[Agent] | tuple[Agent, ...], rank: int = 0) -> list[int]:
    """The training steps global rank ``rank`` logged, over the logs of ``agents``, in time order."""
    lines = [(t, step) for agent in agents for t, r, step in agent.step_times() if r == rank]
    return [step for _, step in sorted(lines)]


def steps_trained_twice(agents: list[Agent] | tuple[Agent, ...]) -> dict[int, int]:
    """Step number -> count for each step that rank 0 logged more than once (a step lost and redone)."""
    return {step: n for step, n in Counter(rank_steps(agents)).items() if n > 1}


def resumed_steps(agent: Agent, rank: int = 0) -> list[int]:
    """The steps that ``rank`` resumed from in this agent's log, in order."""
    return [int(step) for r, _, step in RESUME_LINE.findall(agent.log()) if int(r) == rank]


def preempted_steps(agent: Agent) -> set[int]:
    """The steps at which the workers in this agent's log reported a preemption."""
    return {int(step) for _, step in PREEMPTED_LINE.findall(agent.log())}


# torchrun reports the failed worker group (at WARNING/ERROR, so always printed) before it restarts it.
RESTART_MARK = re.compile(r"failed \(exitcode|closing signal SIG")


def recovery_seconds(agent: Agent, killed_at: float) -> float | None:
    """Seconds from a kill to the first training step of the group the agent restarted afterwards."""
    later = [t for t, _, _ in agent.step_times(after=RESTART_MARK) if t > killed_at]
    return min(later) - killed_at if later else None


# torch's own log lines (LOGLEVEL=INFO): "I1201 13:51:44.086000 27405 .../api.py:707] [default] Rendezvous'ing ...".
_TORCH_LINE = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d{6}) \d+ \S+\] (.*)$", re.M)


def torch_line_times(agent: Agent, pattern: str) -> list[float]:
    """Epoch times of the agent's torch log lines matching ``pattern`` (they carry no year: the start gives it)."""
    year, regex = datetime.fromtimestamp(agent.started).year, re.compile(pattern)
    return [
        datetime.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S.%f").timestamp()
        for stamp, message in _TORCH_LINE.findall(agent.log())
        if regex.search(message)
    ]


def recovery_parts(agent: Agent, killed_at: float) -> dict[str, float]:
    """Where :func:`recovery_seconds` went, in seconds that add up to it: ``stop`` (the kill to the agent's new
    rendezvous: its old workers fail and exit), ``rendezvous`` (to the last "Starting worker group" before the new
    group's first step), ``start`` (new workers start, build the job and train that step). Empty when a part is
    missing from the log (torch logs these lines at INFO, which Agent sets)."""
    first_step = recovery_seconds(agent, killed_at)
    rendezvous = [t for t in torch_line_times(agent, r"Rendezvous'ing worker group") if t > killed_at]
    if first_step is None or not rendezvous:
        return {}
    stepped = killed_at + first_step
    started = [t for t in torch_line_times(agent, r"Starting worker group") if rendezvous[0] < t <= stepped]
    if not started:
        return {}
    return {
        "stop": rendezvous[0] - killed_at,
        "rendezvous": started[-1] - rendezvous[0],
        "start": stepped - started[-1],
    }
