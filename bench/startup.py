"""Time to the first step: where a start's seconds go, the service against the seed's bare recipe.

All three train the demo's UNet on the same shapes data with SGD at 2 gloo processes (``--world``), one
optimizer step, and they alternate within one invocation (``--rounds``) so drift on the machine hits them alike:
the bare recipe and the service (``-m service train``) under ``torchrun --standalone``, and the service under
``ddp-service launch`` (the same agent; its workers forked from a fork server that has imported torch and the
service while the agent rendezvoused). From the moment the agent's command is started to rank 0's first step
done, each phase's end (medians over rounds):

- the service: ``summary.json``'s ``startup`` (service/telemetry/startup.py): the worker's process start, the
  program's first line, its imports, the process group, the config and resume agreements, the runtime (lock,
  roles, watchdog), the task built, the model wrapped, the task ready (kept state, probes), the first batch, the
  first step;
- the bare recipe (the seed's: ``init_process_group``, ``DistributedSampler``, ``DDP``, a loop): the same marks
  where it has them.

Prints the table, the ratio to bare of the whole for each service arm (target <= 1.1), and its own start-up work
after its imports (from imported to its first step, less what the bare recipe spends on the same span; target
< 1 s).

    python bench/startup.py [--rounds 5] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one
TRAIN_SIZE = 512
PHASES = ("process_start", "entry", "imports", "group_up", "config_agreed", "resume_agreed", "runtime", "task_built",
          "model_wrapped", "task_ready", "first_batch", "first_step")  # fmt: skip


def process_start() -> float:
    from service.telemetry.goodput import process_start_time

    return process_start_time() or time.time()


def bare_worker(out: Path) -> None:
    """The seed's recipe, marking each phase's end (Unix times); rank 0 writes them."""
    marks = {"process_start": process_start(), "entry": time.time()}
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from service.tasks.shapes import UNet, make_shapes

    marks["imports"] = time.time()
    dist.init_process_group("gloo")
    marks["group_up"] = time.time()
    torch.manual_seed(0)
    dataset = make_shapes(TRAIN_SIZE, 32, seed=0)
    model = UNet()
    marks["task_built"] = time.time()
    model = DistributedDataParallel(model)
    marks["model_wrapped"] = time.time()
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, masks = next(iter(loader))
    marks["first_batch"] = time.time()
    optimizer.zero_grad()
    criterion(model(images), masks).backward()
    optimizer.step()
    marks["first_step"] = time.time()
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(marks))
    del model, optimizer
    dist.destroy_process_group()


def run(mode: str, world: int) -> dict[str, float]:
    """Seconds from torchrun's start to each phase's end, on rank 0."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
        job = ["--set", f"run_dir={tmp}/run", "--set", "train.max_steps=1", "--set",
               f"task_options.train_size={TRAIN_SIZE}", "--set", "train.progress_bar=false"]  # fmt: skip
        if mode == "bare":
            out = Path(tmp) / "marks.json"
            cmd = [*torchrun, __file__, "--worker", str(out)]
        elif mode == "service":
            cmd = [*torchrun, "-m", "service", "train", *job]
        else:  # ddp-service launch: the same agent, workers forked from its preloaded fork server
            cmd = [sys.executable, "-m", "service", "launch", f"--nproc-per-node={world}", *job]
        launched = time.time()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"the {mode} run failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
        if mode == "bare":
            marks = json.loads(out.read_text())
            return {name: at - launched for name, at in marks.items()}
        startup = json.loads((Path(tmp) / "run" / "summary.json").read_text())["startup"]
        began = startup["process_start"] - launched
        return {"process_start": began, **{name: began + at for name, at in startup["phases"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        bare_worker(args.worker)
        return
    modes = ("bare", "service", "launch")
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            samples[mode].append(run(mode, args.world))
        firsts = ", ".join(f"{mode} first step at {samples[mode][-1]['first_step']:.2f} s" for mode in samples)
        print(f"round {round_ + 1}/{args.rounds}: {firsts}", flush=True)

    def median(mode: str, phase: str) -> float | None:
        values = [marks[phase] for marks in samples[mode] if phase in marks]
        return statistics.median(values) if values else None

    print(f"\n{'phase ends (s from the agent start)':<36}{'service':>10}{'launch':>10}{'bare':>10}")
    for phase in PHASES:
        cells = [median(mode, phase) for mode in ("service", "launch", "bare")]
        print(f"{phase:<36}" + "".join(f"{cell:>10.2f}" if cell is not None else f"{'-':>10}" for cell in cells))
    bare = median("bare", "first_step")
    for mode in ("service", "launch"):
        first = median(mode, "first_step")
        own = (first - median(mode, "imports")) - (bare - median("bare", "imports"))  # type: ignore[operator]
        print(
            f"to the first step, {mode}: {first:.2f} s against bare {bare:.2f} s: ratio {first / bare:.3f} "  # type: ignore[operator]
            f"(target <= 1.1); its own work after its imports, beyond the bare recipe's: {own:.2f} s (target < 1 s)"
        )
    print(f"world {args.world}, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
