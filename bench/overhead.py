"""The service's training loops (the task loop, and a script's own loop on ``service.Session``) against a bare,
hand-written DDP loop in the seed's style, epoch for epoch in the same processes.

Same model (the shapes UNet), data, batch, SGD (lr 0.05, momentum 0.9) and
gloo processes (``--world``, 2 by default). What is compared:

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
  the plan sampler, the checked collate, the in-memory snapshots
  (``checkpoint.snapshot_every: auto``, at most 1% of the step time by
  construction) and the hang watchdog (the loop's progress marks, and its
  thread publishing once a second).

**Interleaved in one job.** Each round is one ``torchrun`` job per service
loop (``service``: the task loop; ``session``: the bare loop's step in a
script on ``service.Session``) in which every epoch of the service's loop is
paired with an epoch of the bare loop (its own DDP model, DistributedSampler and
DataLoader, on the same process group), the two in turn, first one then the
other (ABBA), in the same processes. On this 2-core VM the speed of a process
swings by up to 30% from one start to the next (the same bare loop: 5.8 and 7.6
ms of forward in two consecutive runs), far more than the 1% measured, so
separate jobs per loop cannot show it; within one process the pair sees the
same CPU. Both loops then also run beside the service's background threads
(the hang watchdog, the snapshot writer, gloo's): their CPU is counted apart,
per step of the service's loop, from ``/proc/self/task`` on rank 0.

Prints, per loop: the median wall and main-thread CPU time per step of the
service's epochs and of their bare partners, the median of the pairs' ratios
bare / service (target >= 0.99) and their spread (quartiles, range, how many
pairs reach 0.99: on a VM whose speed swings, the spread says whether a median
below 0.99 is the loop or the machine), the main thread's CPU outside the
step's body against the bare partner's (the loop's own work per step: the
service's boundary and its data path, against the bare DataLoader; far steadier
than the wall ratio, since the step's body is left out), and the background
threads' CPU per step.

    python bench/overhead.py [--rounds 3] [--epochs 4] [--train-size 2048] [--batch 8] [--world 2] [--grad-clip 1.0]
                             [--task builtin|step_fn] [--loops service,session] [--set KEY=VALUE ...]

The session loop runs the bare loop's step in a script on ``service.Session``:
the same boundary as the task loop, the same step as the bare loop.

``--task step_fn`` runs the task loop on the same task given as a ``step_fn``
(``Task.step_fn`` instead of ``loss_fn``), the path real training code takes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every job of one invocation runs: its command line's choices."""

    epochs: int
    batch: int
    size: int  # training samples (an epoch: size / (batch x world) steps)
    task: str
    clip: float | None
    sets: tuple[str, ...]


def shapes_own_step(spec):  # noqa: ANN001, ANN201 - a task function: TaskSpec -> Task
    """The built-in shapes task with its loss given as a ``step_fn``, as a ported training script would."""
    from service.tasks.shapes import build

    task = build(spec)
    loss_fn = task.loss_fn
    return dataclasses.replace(task, loss_fn=None, step_fn=lambda model, batch: loss_fn(model(batch[0]), batch[1]))


Epoch = dict  # one timed epoch: {"loop": "bare" or the service's, "wall": s/step, "cpu": main thread s/step, ...}


def worker(mode: str, setup: Setup, out: Path) -> None:
    """Runs under torchrun: the service's loop (``mode``) and the bare loop in turn; rank 0 writes its epochs."""
    rows = session(setup) if mode == "session" else service(setup)
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(rows))


class Bare:
    """The seed's loop: DDP + DistributedSampler + SGD and the service's clipping (``--grad-clip``), on the process
    group the service has set up; one epoch per call."""

    def __init__(self, setup: Setup) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler

        from service.tasks.shapes import UNet, make_shapes

        torch.manual_seed(0)
        dataset = make_shapes(setup.size, 32, seed=0)
        self.sampler = DistributedSampler(dataset, seed=0)
        self.loader = DataLoader(dataset, batch_size=setup.batch, shuffle=False, sampler=self.sampler)
        self.model = DDP(UNet())
        self.criterion = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.clip = setup.clip
        self.epoch = 0

    def run_epoch(self) -> Epoch:
        import torch.distributed as dist

        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        dist.barrier()
        with Clocks("bare") as clocks:
            for images, masks in self.loader:
                with clocks.body():
                    bare_step(self.model, self.optimizer, self.criterion, images, masks, self.clip)
        return clocks.row

    def close(self) -> None:
        """Free DDP before the process group goes (gloo can hang or abort at exit otherwise)."""
        del self.model, self.optimizer
        gc.collect()


def bare_step(model, optimizer, criterion, images, masks, clip):  # noqa: ANN001, ANN201 - torch objects
    """The seed's step, the same in the bare loop and the session's: zero, forward, backward, clip, update."""
    import torch

    optimizer.zero_grad()
    loss = criterion(model(images), masks)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss


class Clocks:
    """Wall and main-thread CPU seconds per step of one epoch, the part of that CPU outside the step's body (the
    loop's own: fetching the batch, and the service's boundary), and the other threads' CPU seconds in it."""

    def __init__(self, loop: str) -> None:
        self.loop, self.steps, self.row, self.inside = loop, 0, {}, 0.0

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        """One step's body: the same code in a service loop and its bare partner, so what lies outside it is the
        loop's own CPU, which the process's speed swings touch far less than the step's."""
        began = time.thread_time()
        yield
        self.inside += time.thread_time() - began
        self.steps += 1

    def __enter__(self) -> Clocks:
        self.others = background_cpu()
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu
        steps = max(self.steps, 1)
        others = {name: seconds - self.others.get(name, 0.0) for name, seconds in background_cpu().items()}
        self.row = {"loop": self.loop, "wall": wall / steps, "cpu": cpu / steps, "steps": self.steps,
                    "outside": (cpu - self.inside) / steps,
                    "background": sum(others.values()) / steps,
                    "threads": {name: seconds / steps for name, seconds in others.items() if seconds > 0}}  # fmt: skip


def background_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads other than the main one (``/proc/self/task``), by thread name."""
    found: dict[str, float] = {}
    main, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc/self/task"):
        if int(entry.name) == main:
            continue
        try:
            name = Path(entry.path, "comm").read_text().strip()
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return found


def _overrides(setup: Setup, run_dir: str) -> list[str]:
    return [
        f"train.batch_size={setup.batch}", f"train.epochs={setup.epochs}", f"task_options.train_size={setup.size}",
        "train.sync_batchnorm=off", "train.progress_bar=false", "train.log_every=1000000",
        "metrics.tensorboard=false", "metrics.port=0", "checkpoint.every_steps=0", "checkpoint.resume=never",
        f"run_dir={run_dir}", *setup.sets,
    ]  # fmt: skip


def interleave(epoch: int, bare: Bare, own: Callable[[], Epoch]) -> list[Epoch]:
    """One pair: the bare epoch first on even epochs, the service's first on odd ones (ABBA against drift)."""
    pair = [bare.run_epoch, own] if epoch % 2 == 0 else [own, bare.run_epoch]
    return [run() for run in pair]


def service(setup: Setup) -> list[Epoch]:
    """The service's task loop, built exactly as ``ddp-service train`` builds it (a Runtime, the task's job)."""
    import torch.distributed as dist
    from paired import task_epoch

    from service.config import load_config
    from service.loop.runtime import Runtime
    from service.loop.stepping import Hooks
    from service.loop.train import build_job
    from service.state.preemption import Preemption
    from service.world.env import detect_world

    extra = [f"train.grad_clip={'null' if setup.clip is None else setup.clip}",
             *(["task=overhead:shapes_own_step"] if setup.task == "step_fn" else [])]  # fmt: skip
    rows: list[Epoch] = []
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(None, [*_overrides(setup, run_dir), *extra])
        with Runtime.opened(config, detect_world(os.environ), Preemption()) as runtime:
            job = build_job(runtime)
            hooks = Hooks(stepped=job.nonfinite.check, epoch_start=job.model.train)
            bare = Bare(setup)

            def own() -> Epoch:
                dist.barrier()
                with Clocks("service") as clocks:
                    task_epoch(runtime, job, hooks, clocks.body)
                return clocks.row

            for epoch in range(setup.epochs):
                rows += interleave(epoch, bare, own)
            bare.close()
    return rows


def session(setup: Setup) -> list[Epoch]:
    """The seed's loop written on ``service.Session``: the same step as the bare loop, the service around it."""
    import torch
    import torch.distributed as dist

    import service
    from service.tasks.shapes import UNet, make_shapes

    rows: list[Epoch] = []
    with tempfile.TemporaryDirectory() as tmp, service.Session(overrides=_overrides(setup, tmp)) as s:
        torch.manual_seed(0)
        dataset = make_shapes(setup.size, 32, seed=0)
        model = s.model(UNet())
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        s.keep(model=model, optimizer=optimizer)
        bare = Bare(setup)

        def own() -> Epoch:
            dist.barrier()
            with Clocks("session") as clocks:
                for images, masks in s.batches(dataset, setup.batch):
                    with clocks.body():
                        loss = bare_step(model, optimizer, criterion, images, masks, setup.clip)
                    s.log(loss=loss.detach())
            return clocks.row

        for epoch in s.epochs():
            rows += interleave(epoch, bare, own)
        bare.close()
    return rows


def run(mode: str, args: argparse.Namespace) -> list[Epoch]:
    """Rank 0's timed epochs of one job (the first pair left out: it warms up allocators and threads)."""
    from paired import launch

    worker_args = [mode, "--epochs", str(args.epochs), "--batch", str(args.batch), "--task", args.task,
                   "--grad-clip", str(args.grad_clip), "--train-size", str(args.train_size),
                   *(item for override in args.set for item in ("--set", override))]  # fmt: skip
    return launch(__file__, args.world, worker_args, f"{mode} run")[2:]


def clip_value(text: str) -> float | None:
    return None if text.lower() in ("none", "null") else float(text)


def summarize(loop: str, rows: list[Epoch]) -> str:
    """One line per service loop: its epochs and their bare partners, the pairs' ratios, the other threads' CPU;
    then those threads by name."""
    own = [r for r in rows if r["loop"] == loop]
    bare = [r for r in rows if r["loop"] == "bare"]
    ratios = [b["wall"] / o["wall"] for b, o in zip(bare, own, strict=True)]
    wall = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [wall, wall, wall]
    cpu = statistics.median(b["cpu"] / o["cpu"] for b, o in zip(bare, own, strict=True))

    def ms(epochs: list[Epoch], key: str) -> float:
        return statistics.median(e[key] for e in epochs) * 1e3

    def by_thread(epochs: list[Epoch]) -> dict[str, float]:
        names = {name for e in epochs for name in e["threads"]}
        return {name: statistics.mean(e["threads"].get(name, 0.0) for e in epochs) * 1e3 for name in names}

    # The main thread's CPU outside the step's body, each service epoch against its bare partner: what the loop
    # itself adds per step, as a share of the service epoch's main-thread CPU per step.
    extra = statistics.median(o["outside"] - b["outside"] for b, o in zip(bare, own, strict=True))
    share = statistics.median((o["outside"] - b["outside"]) / o["cpu"] for b, o in zip(bare, own, strict=True))
    mine, theirs = by_thread(own), by_thread(bare)
    threads = ", ".join(f"{name} {mine.get(name, 0):.2f}/{theirs.get(name, 0):.2f}"
                        for name in sorted({*mine, *theirs}, key=lambda n: -mine.get(n, 0)))  # fmt: skip
    return (f"{loop:<9}{ms(bare, 'wall'):>9.2f}{ms(own, 'wall'):>9.2f}{ms(bare, 'cpu'):>10.2f}{ms(own, 'cpu'):>10.2f}"
            f"{wall:>8.3f}{cpu:>8.3f}{ms(bare, 'background'):>9.2f}{ms(own, 'background'):>9.2f}{len(own):>7}\n"
            f"         the pairs' wall ratios: quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, range "
            f"{min(ratios):.3f}-{max(ratios):.3f}; {sum(r >= 0.99 for r in ratios)} of {len(ratios)} pairs >= 0.99\n"
            f"         main thread outside the step's body, CPU ms per step: {ms(own, 'outside'):.3f} against "
            f"{ms(bare, 'outside'):.3f} bare; the loop's own {extra * 1e3:+.3f} ms, {share:.2%} of its step\n"
            f"         other threads, CPU ms per step ({loop} / bare): {threads}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each loop in each job")
    parser.add_argument("--train-size", type=int, default=2048, help="training samples (2048: 128 steps an epoch)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--world", type=int, default=2, help="processes (gloo ranks)")
    parser.add_argument("--task", choices=["builtin", "step_fn"], default="builtin")
    parser.add_argument("--loops", default="service,session", help="the service's loops to run, each against bare")
    parser.add_argument("--grad-clip", type=clip_value, default=1.0, help="both loops; none: neither clips")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the service's loops (e.g. checkpoint.snapshot_every=0)",
    )
    parser.add_argument("--worker", choices=["service", "session"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        setup = Setup(args.epochs, args.batch, args.train_size, args.task, args.grad_clip, tuple(args.set))
        worker(args.worker, setup, args.out)
        return
    loops = [loop for loop in args.loops.split(",") if loop]
    rows: dict[str, list[Epoch]] = {loop: [] for loop in loops}
    for round_ in range(args.rounds):
        for loop in loops[round_ % len(loops) :] + loops[: round_ % len(loops)]:
            rows[loop] += run(loop, args)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\n{args.task} task, world {args.world}, grad_clip {args.grad_clip}, batch {args.batch}, "
          f"{' '.join(args.set) or 'the defaults'}; per step, medians "
          "over the epochs (bare: the paired bare epochs of the same jobs)")  # fmt: skip
    print(f"{'loop':<9}{'bare ms':>9}{'loop ms':>9}{'bare CPU':>10}{'loop CPU':>10}{'ratio':>8}{'CPU r.':>8}"
          f"{'bare bg':>9}{'loop bg':>9}{'epochs':>7}")  # fmt: skip
    for loop in loops:
        print(summarize(loop, rows[loop]))
    print(
        "ratio: the median over the pairs of bare / loop wall time per step (target >= 0.99); CPU r.: the same for "
        "the main thread's CPU; bg: the other threads' CPU ms per step, in the service's epochs and in the bare ones"
    )


if __name__ == "__main__":
    main()
