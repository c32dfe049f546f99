"""The service's training loop against a bare, hand-written DDP loop in the seed's style.

Same model (the shapes UNet), data, batch and 2 gloo processes; the two
alternate within one invocation so drift on the machine hits both alike.
Metrics, checkpoints, TensorBoard and the progress bar are off in the service,
and SyncBatchNorm too (the bare loop has plain BatchNorm). Prints the median
step time of each and the throughput ratio service / bare (target >= 0.99).

    python bench/overhead.py [--rounds 3] [--epochs 4] [--batch 8] [--task builtin|step_fn]

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


def worker(mode: str, epochs: int, batch: int, out: Path, task: str) -> None:
    """Runs under torchrun; writes this rank's seconds per step for each epoch."""
    times = bare(epochs, batch) if mode == "bare" else service(epochs, batch, task)
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(times))


def bare(epochs: int, batch: int) -> list[float]:
    """The seed's loop: DDP + DistributedSampler + SGD, nothing else."""
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
        start = time.perf_counter()
        for images, masks in loader:
            optimizer.zero_grad()
            loss = criterion(model(images), masks)
            loss.backward()
            optimizer.step()
        times.append((time.perf_counter() - start) / len(loader))
    # Untimed teardown: free DDP before its process group, or gloo can hang or abort at exit
    # (the reason service.world.distributed.shutdown_distributed collects first).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return times


def service(epochs: int, batch: int, task: str) -> list[float]:
    """The service's own loop (``train_epoch``), built exactly as ``ddp-service train`` builds it."""
    from service.config import load_config
    from service.loop.train import build_job
    from service.world.distributed import distributed
    from service.world.env import detect_world

    overrides = [
        f"train.batch_size={batch}", f"train.epochs={epochs}", f"task_options.train_size={TRAIN_SIZE}",
        "train.sync_batchnorm=off", "train.progress_bar=false", "train.log_every=1000000",
        "metrics.tensorboard=false", "metrics.port=0", "checkpoint.every_steps=0", "checkpoint.resume=never",
        *(["task=overhead:shapes_own_step"] if task == "step_fn" else []),
    ]  # fmt: skip
    world = detect_world(os.environ)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(None, [*overrides, f"run_dir={run_dir}"])
        with distributed(world, config.dist.backend, config.dist.timeout_seconds) as ctx:
            return _time_service_epochs(build_job(config, world, ctx), epochs)


def _time_service_epochs(job, epochs: int) -> list[float]:  # noqa: ANN001 - a service.loop.train.Job
    """Seconds per step of each epoch; the job dies with this frame, before its process group."""
    import torch.distributed as dist

    from service.loop.job import LoopState
    from service.loop.train import _Window, train_epoch

    state, window, times = LoopState(), _Window(job.device), []
    for epoch in range(epochs):
        state.epoch, state.cursor = epoch, 0
        dist.barrier()
        start = time.perf_counter()
        train_epoch(job, state, window, [])
        times.append((time.perf_counter() - start) / job.plan.steps_in_epoch(0))
    job.roles.close()
    return times


def run(mode: str, epochs: int, batch: int, task: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            __file__,
            "--worker",
            mode,
            "--epochs",
            str(epochs),
            "--batch",
            str(batch),
            "--task",
            task,
            "--out",
            str(out),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"The {mode} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        return json.loads(out.read_text())[1:]  # the first epoch warms up allocators and threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--task", choices=["builtin", "step_fn"], default="builtin")
    parser.add_argument("--worker", choices=["bare", "service"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.epochs, args.batch, args.out, args.task)
        return
    samples: dict[str, list[float]] = {"bare": [], "service": []}
    for round_ in range(args.rounds):
        order = ("bare", "service") if round_ % 2 == 0 else ("service", "bare")
        for mode in order:
            samples[mode] += run(mode, args.epochs, args.batch, args.task)
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{m} {statistics.median(v) * 1e3:.2f} ms/step" for m, v in samples.items()), flush=True)  # fmt: skip
    bare_ms = statistics.median(samples["bare"]) * 1e3
    service_ms = statistics.median(samples["service"]) * 1e3
    print(f"\n{'loop':<10}{'median ms/step':>16}{'epochs timed':>14}")
    print(f"{'bare':<10}{bare_ms:>16.2f}{len(samples['bare']):>14}")
    print(f"{'service':<10}{service_ms:>16.2f}{len(samples['service']):>14}")
    print(f"\nthroughput ratio service/bare ({args.task} task): {bare_ms / service_ms:.3f} (target >= 0.99)")


if __name__ == "__main__":
    main()
