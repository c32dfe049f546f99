"""The service's training loops (the task loop, and a script's own loop on ``service.Session``) against a bare,
hand-written DDP loop in the seed's style.

Same model (the shapes UNet), data, batch, SGD (lr 0.05, momentum 0.9) and
gloo processes (``--world``, 2 by default); the two alternate within one
invocation so drift on the machine hits both alike. What is compared:

- clipping: both clip the gradient norm to ``--grad-clip`` (1.0, the
  service's default ``train.grad_clip``). Clipping is training math the job
  asked for, not overhead, so the bare loop does it too; the service's
  non-finite guard then reuses the clip's norm. ``--grad-clip none`` turns it
  off in both, and the service pays the guard's own norm (one fused norm).
- off in the service: metrics, checkpoints, TensorBoard, the progress bar and
  SyncBatchNorm (the bare loop has plain BatchNorm).
- on in the service, as in every job: the per-step RNG reseed, the LR
  schedule (LambdaLR, cosine; the bare keeps its lr: the same work per step),
  the non-finite guard (``train.nonfinite: stop``), the preemption agreement,
  the plan sampler, the checked collate, and the hang watchdog (the loop's
  progress marks, and its thread publishing once a second).

Prints each loop's median step time on two clocks, wall and CPU
(``time.process_time`` of rank 0, all its threads), and the throughput ratio
service / bare (target >= 0.99). On a shared machine both clocks swing by
several percent between runs: a 1% difference needs an idle machine, or the
per-call costs measured in isolation.

    python bench/overhead.py [--rounds 3] [--epochs 4] [--batch 8] [--world 2] [--grad-clip 1.0]
                             [--task builtin|step_fn]

The session mode runs the bare loop's step in a script on ``service.Session``:
the same boundary as the task loop, the same step as the bare loop.

``--task step_fn`` runs the service on the same task given as a ``step_fn``
(``Task.step_fn`` instead of ``loss_fn``), the path real training code takes.
"""

from __future__ import annotations

import argparse
import gc
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


def shapes_own_step(spec):  # noqa: ANN001, ANN201 - a task function: TaskSpec -> Task
    """The built-in shapes task with its loss given as a ``step_fn``, as a ported training script would."""
    import dataclasses

    from service.tasks.shapes import build

    task = build(spec)
    loss_fn = task.loss_fn
    return dataclasses.replace(task, loss_fn=None, step_fn=lambda model, batch: loss_fn(model(batch[0]), batch[1]))


def worker(mode: str, epochs: int, batch: int, out: Path, task: str, clip: float | None) -> None:
    """Runs under torchrun; writes this rank's (wall, CPU) seconds per step for each epoch."""
    if mode == "bare":
        times = bare(epochs, batch, clip)
    elif mode == "session":
        times = session(epochs, batch, clip)
    else:
        times = service(epochs, batch, task, clip)
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(times))


def bare(epochs: int, batch: int, clip: float | None) -> list[tuple[float, float]]:
    """The seed's loop: DDP + DistributedSampler + SGD, and the service's clipping (``--grad-clip``)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from service.tasks.shapes import UNet, make_shapes

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = make_shapes(TRAIN_SIZE, 32, seed=0)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=batch, shuffle=False, sampler=sampler)
    model = DDP(UNet())
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for images, masks in loader:
            optimizer.zero_grad()
            loss = criterion(model(images), masks)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        times.append(((time.perf_counter() - start) / len(loader), (time.process_time() - cpu) / len(loader)))
    # Untimed teardown: free DDP before its process group, or gloo can hang or abort at exit
    # (the reason service.world.distributed.shutdown_distributed collects first).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return times


def _overrides(epochs: int, batch: int, run_dir: str) -> list[str]:
    return [
        f"train.batch_size={batch}", f"train.epochs={epochs}", f"task_options.train_size={TRAIN_SIZE}",
        "train.sync_batchnorm=off", "train.progress_bar=false", "train.log_every=1000000",
        "metrics.tensorboard=false", "metrics.port=0", "checkpoint.every_steps=0", "checkpoint.resume=never",
        f"run_dir={run_dir}",
    ]  # fmt: skip


def service(epochs: int, batch: int, task: str, clip: float | None) -> list[tuple[float, float]]:
    """The service's task loop, built exactly as ``ddp-service train`` builds it (a Runtime, the task's job)."""
    from service.config import load_config
    from service.loop.runtime import Runtime
    from service.loop.train import build_job
    from service.state.preemption import Preemption
    from service.world.env import detect_world

    extra = [f"train.grad_clip={'null' if clip is None else clip}",
             *(["task=overhead:shapes_own_step"] if task == "step_fn" else [])]  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(None, [*_overrides(epochs, batch, run_dir), *extra])
        with Runtime.opened(config, detect_world(os.environ), Preemption()) as runtime:
            return _time_task_epochs(build_job(runtime), epochs)


def _time_task_epochs(job, epochs: int) -> list[tuple[float, float]]:  # noqa: ANN001 - a service.loop.train.TaskJob
    """Seconds per step of each epoch's steps (the task loop's step, the shared boundary; no evaluation)."""
    import torch.distributed as dist

    from service.loop.stepping import Hooks, steps
    from service.loop.train import optimizer_step

    runtime, times = job.runtime, []
    hooks = Hooks(stepped=job.nonfinite.check, epoch_start=job.model.train)
    for _ in range(epochs):
        dist.barrier()
        start, cpu, count = time.perf_counter(), time.process_time(), 0
        for fed in steps(runtime, job.feed, hooks, one_epoch=True):
            runtime.log({"loss": optimizer_step(job, fed.plan, fed.batches, runtime.state.global_step + 1)})
            count += 1
        times.append(((time.perf_counter() - start) / count, (time.process_time() - cpu) / count))
    return times


def session(epochs: int, batch: int, clip: float | None) -> list[tuple[float, float]]:
    """The seed's loop written on ``service.Session``: the same step as the bare loop, the service around it."""
    import torch
    import torch.distributed as dist

    import service
    from service.tasks.shapes import UNet, make_shapes

    times = []
    with tempfile.TemporaryDirectory() as run_dir, service.Session(overrides=_overrides(epochs, batch, run_dir)) as s:
        torch.manual_seed(0)
        dataset = make_shapes(TRAIN_SIZE, 32, seed=0)
        model = s.model(UNet())
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        s.keep(model=model, optimizer=optimizer)
        for _ in s.epochs():
            dist.barrier()
            start, cpu, count = time.perf_counter(), time.process_time(), 0
            for images, masks in s.batches(dataset, batch):
                optimizer.zero_grad()
                loss = criterion(model(images), masks)
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                s.log(loss=loss.detach())
                count += 1
            times.append(((time.perf_counter() - start) / count, (time.process_time() - cpu) / count))
    return times


def run(mode: str, args: argparse.Namespace) -> list[list[float]]:
    """(wall, CPU) seconds per step of rank 0's epochs, the first (warm-up) left out."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
               __file__, "--worker", mode, "--epochs", str(args.epochs), "--batch", str(args.batch),
               "--task", args.task, "--grad-clip", str(args.grad_clip), "--out", str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"The {mode} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        return json.loads(out.read_text())[1:]  # the first epoch warms up allocators and threads


def clip_value(text: str) -> float | None:
    return None if text.lower() in ("none", "null") else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--world", type=int, default=2, help="processes (gloo ranks)")
    parser.add_argument("--task", choices=["builtin", "step_fn"], default="builtin")
    parser.add_argument("--grad-clip", type=clip_value, default=1.0, help="both loops; none: neither clips")
    parser.add_argument("--worker", choices=["bare", "service", "session"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.epochs, args.batch, args.out, args.task, args.grad_clip)
        return
    samples: dict[str, list[list[float]]] = {"bare": [], "service": [], "session": []}

    def ms(mode: str, clock: int) -> float:
        return statistics.median(epoch[clock] for epoch in samples[mode]) * 1e3

    for round_ in range(args.rounds):
        modes = ("bare", "service", "session")
        order = modes[round_ % 3 :] + modes[: round_ % 3]  # each mode first in turn
        for mode in order:
            samples[mode] += run(mode, args)
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{m} {ms(m, 0):.2f} ms/step ({ms(m, 1):.2f} CPU)" for m in samples), flush=True)  # fmt: skip
    print(f"\n{'loop':<10}{'wall ms/step':>14}{'CPU ms/step':>13}{'epochs timed':>14}")
    for mode in samples:
        print(f"{mode:<10}{ms(mode, 0):>14.2f}{ms(mode, 1):>13.2f}{len(samples[mode]):>14}")
    print(
        f"\nthroughput ratio service/bare ({args.task} task, world {args.world}, grad_clip {args.grad_clip}): "
        f"{ms('bare', 0) / ms('service', 0):.3f} wall, {ms('bare', 1) / ms('service', 1):.3f} CPU (target >= 0.99)"
    )
    print(
        f"throughput ratio session/bare (the same step in a script's own loop): "
        f"{ms('bare', 0) / ms('session', 0):.3f} wall, {ms('bare', 1) / ms('session', 1):.3f} CPU (target >= 0.99)"
    )
    print(
        f"throughput ratio session/task loop: {ms('service', 0) / ms('session', 0):.3f} wall, "
        f"{ms('service', 1) / ms('session', 1):.3f} CPU (target: within 1%)"
    )


if __name__ == "__main__":
    main()
