"""The service's own CPU cost per step: a nearly empty step through each door, against the same loop written bare.

The step's body is a tiny model (``Linear(1, 1)`` by default, ``--width``/``--layers`` for a bigger one) on a
batch of ``--batch`` random pairs, so what a step costs beyond the bare loop is the service's work at the step
boundary. Each door runs ``--steps`` steps (one epoch) in the same processes as a bare loop of the same steps
(DDP, DistributedSampler, DataLoader, SGD), the order flipped every run (ABBA), at each world size of
``--worlds`` (gloo processes under ``torchrun --standalone``):

- ``task``: the ``Task`` loop as ``ddp-service train`` runs it (``paired.task_epoch``), with the config's
  defaults but ``metrics.port=auto`` (Prometheus on, as a production job has it); ``--exporter off`` keeps the
  config's own default (``metrics.port=0``: no exporter, so no comm hook);
- ``task -hook``: with the exporter on, the same with ``metrics.allreduce_timing=false`` (DDP's built-in
  all-reduce: no comm hook, no pre-forward timers, no collective histograms);
- ``session``: the same step in a script's own loop on ``service.Session`` (``s.batches``, ``s.log``).

Measured in CPU time, which this loaded 2-core VM disturbs far less than wall time: the main thread's
(``time.thread_time``) and the whole process's (``time.process_time``: gloo's threads, the comm hook's callbacks,
the watchdog, the snapshot writer, the metrics server). Then one more epoch of each door under cProfile, its
service functions grouped into items (seeding, counting, the log window, the sinks, progress marks, the
preemption check, save_due, the comm hook, forward marks, the data path): the item table is µs per step under the
profiler, which adds about a microsecond to every Python call it sees, so its items read high; the totals above
it are unprofiled.

    python bench/boundary.py [--steps 10000] [--runs 1] [--worlds 1,2] [--batch 1] [--width 1] [--layers 1]
                             [--doors task,session] [--exporter on|off] [--set KEY=VALUE ...]

Snapshot captures and periodic checkpoints are timed apart (``Writes``: main-thread CPU of each capture, and of
each checkpoint at the steps one is due), and each door's line says its CPU over bare **between its writes**: at
``auto`` a model this small is snapshotted at every step (its snapshot costs far under 0.5% of a step), and a
checkpoint comes every 50 steps, so the boundary's own work is the total less those.

``--runs 5`` prints each figure's spread (min-max) over 5 runs. Where CUDA is available the service and the bare
loop run on the GPU (NCCL), as ``make gpu-check`` does with a model and batch that make a step take 5-20 ms.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # this tree's service; paired.py


def tiny(spec):  # noqa: ANN001, ANN201 - a task function: TaskSpec -> Task
    """``layers`` x Linear(width, width) on ``train_size`` pairs (one random pair repeated), mean squared error."""
    from service.tasks.base import Task

    model, data = make(int(spec.option("width", 1)), int(spec.option("layers", 1)), int(spec.option("train_size", 64)))
    return Task(model=model, train_set=data, eval_set=data, loss_fn=mse)


def make(width: int, layers: int, size: int) -> tuple[Any, Any]:
    import torch
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    # One random pair, seen ``size`` times (a stride-0 view): no memory however many steps or however wide.
    pair = (torch.randn(1, width, generator=generator).expand(size, width) for _ in range(2))
    data = TensorDataset(*pair)
    return model, data


def mse(output, target):  # noqa: ANN001, ANN201 - tensors
    import torch

    return torch.nn.functional.mse_loss(output, target)


class Writes:
    """A runtime's snapshot captures and checkpoint saves, timed on the main thread: the budget's "between their
    writes" leaves them out. A capture is timed at every call (save_due calls it only when one is due); a periodic
    checkpoint only at the steps it is due, so the steps between pay no clock read for it."""

    def __init__(self, rt: Any) -> None:
        self.seconds, self.snapshots, self.checkpoints = 0.0, 0, 0
        snapshots, checkpointer = rt.roles.snapshots, rt.roles.checkpointer
        capture, save, every = snapshots.capture, checkpointer.maybe_save, rt.config.checkpoint.every_steps

        def timed_capture(step: int, state: Any) -> None:
            began, skipped = time.thread_time(), getattr(snapshots, "skipped", 0)
            capture(step, state)
            self.seconds += time.thread_time() - began
            self.snapshots += getattr(snapshots, "skipped", 0) == skipped  # not one skipped (one in flight)

        def timed_save(step: int, state: Any) -> None:
            if not every or step % every:
                save(step, state)
                return
            began = time.thread_time()
            save(step, state)
            self.seconds += time.thread_time() - began
            self.checkpoints += 1

        snapshots.capture, checkpointer.maybe_save = timed_capture, timed_save

    def take(self) -> tuple[float, int, int]:
        taken = self.seconds, self.snapshots, self.checkpoints
        self.seconds, self.snapshots, self.checkpoints = 0.0, 0, 0
        return taken


class Clock:
    """Wall, main-thread CPU and process CPU seconds of one epoch, per step (and its writes' main-thread CPU)."""

    def __init__(self, door: str, cuda: bool, writes: Writes | None = None) -> None:
        self.door, self.cuda, self.row, self.writes = door, cuda, {}, writes

    def __enter__(self) -> Clock:
        import torch.distributed as dist

        dist.barrier()
        if self.writes is not None:
            self.writes.take()
        self.began = (time.perf_counter(), time.thread_time(), time.process_time())
        return self

    def stop(self, steps: int) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        wall, thread, process = ((b - a) / max(steps, 1) for a, b in zip(self.began, now, strict=True))
        writes, snapshots, checkpoints = self.writes.take() if self.writes is not None else (0.0, 0, 0)
        self.row = {
            "door": self.door,
            "cuda": self.cuda,
            "wall": wall,
            "thread": thread,
            "process": process,
            "steps": steps,
            "writes": writes / max(steps, 1),
            "snapshots": snapshots,
            "checkpoints": checkpoints,
        }

    def __exit__(self, *exc: object) -> None:
        pass


class Bare:
    """The same step written bare: DDP, DistributedSampler, DataLoader, SGD."""

    def __init__(self, args: argparse.Namespace, size: int, device: Any) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler

        model, data = make(args.width, args.layers, size)
        model = model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        self.model = DDP(model, device_ids=ids)  # at world 1 too, as the service does
        self.sampler = DistributedSampler(data, seed=0)
        self.loader = DataLoader(data, batch_size=args.batch, sampler=self.sampler, drop_last=True)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.device, self.epoch = device, 0

    def run(self, clock: Clock) -> None:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        count = 0
        for x, y in self.loader:
            step(self.model, self.optimizer, x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            count += 1
        clock.stop(count)

    def close(self) -> None:
        del self.model, self.optimizer
        gc.collect()


def step(model, optimizer, x, y):  # noqa: ANN001, ANN201 - torch objects
    """The bare loop's step and the session's: zero, forward, backward, clip (to the service's default
    ``train.grad_clip`` 1.0: training math, not overhead; the task loop's guard reuses its norm), update."""
    import torch

    optimizer.zero_grad()
    loss = mse(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def overrides(args: argparse.Namespace, size: int, run_dir: str) -> list[str]:
    exporter = ["metrics.port=auto"] if args.exporter == "on" else []  # off: the config's default, port 0
    return [f"train.batch_size={args.batch}", f"train.epochs={3 * args.runs + 4}", f"run_dir={run_dir}",
            "checkpoint.resume=never", *exporter, "task=boundary:tiny", f"task_options.width={args.width}",
            f"task_options.layers={args.layers}", f"task_options.train_size={size}",
            *args.set]  # fmt: skip


def timed(doors: dict[str, Callable[[Clock], None]], runs: int, cuda: bool,
          writes: dict[str, Writes] | None = None) -> list[dict]:  # fmt: skip
    """A warm-up epoch of each door, then ``runs`` of each in turn, the order flipped every run."""
    rows = []
    names = list(doors)
    for run in range(runs + 1):
        for name in names if run % 2 == 0 else names[::-1]:
            with Clock(name, cuda, (writes or {}).get(name)) as clock:
                doors[name](clock)
            if run:
                rows.append({**clock.row, "run": run})
    return rows


def profiled(door: Callable[[Clock], None], cuda: bool) -> dict[str, float]:
    """One more epoch of ``door`` under cProfile: µs per step by item."""
    profile = cProfile.Profile(time.thread_time)  # CPU time: a wait in a collective costs none
    with Clock("profiled", cuda) as clock:
        profile.enable()
        door(clock)
        profile.disable()
    return {**items(pstats.Stats(profile), clock.row["steps"]), PROFILED: clock.row["thread"] * 1e6}


PROFILED = "the door's main-thread CPU under the profiler"


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: the bare loop and the service's doors (``args.worker``: task or session) in turn."""
    from service.world.env import detect_world

    world = detect_world(os.environ)
    size = args.steps * args.batch * world.world_size
    with tempfile.TemporaryDirectory() as tmp:
        run = session_job if args.worker == "session" else task_job
        rows, table = run(args, size, tmp)
    if world.rank == 0:
        device = "cuda" if any(row.get("cuda") for row in rows) else "cpu"
        args.out.write_text(json.dumps({"rows": rows, "items": table, "device": device}))


def task_job(args: argparse.Namespace, size: int, tmp: str) -> tuple[list[dict], dict]:
    from paired import runtimes, task_epoch

    from service.loop.stepping import Hooks
    from service.loop.train import build_job

    sets = overrides(args, size, tmp)
    settings = {"task": sets}
    if args.exporter == "on":  # without the exporter the comm hook is off already: "task -hook" would be "task"
        settings["task -hook"] = [*sets, "metrics.allreduce_timing=false"]
    with runtimes(settings) as opened:
        cuda = opened["task"].device.type == "cuda"
        bare = Bare(args, size, opened["task"].device)
        jobs = {name: build_job(runtime) for name, runtime in opened.items()}
        hooks = {name: Hooks(stepped=job.nonfinite.check, epoch_start=job.model.train) for name, job in jobs.items()}

        def door(name: str) -> Callable[[Clock], None]:
            return lambda clock: clock.stop(task_epoch(opened[name], jobs[name], hooks[name]))

        writes = {name: Writes(runtime) for name, runtime in opened.items()}
        doors = {"bare": bare.run, **{name: door(name) for name in opened}}
        rows = timed(doors, args.runs, cuda, writes)
        table = profiled(door("task"), cuda)
        bare.close()
    return rows, table


def session_job(args: argparse.Namespace, size: int, tmp: str) -> tuple[list[dict], dict]:
    import torch

    import service

    sets = [item for item in overrides(args, size, tmp) if not item.startswith("task")]
    with service.Session(overrides=sets) as s:
        model, data = make(args.width, args.layers, size)
        model = s.model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        s.keep(model=model, optimizer=optimizer)
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        bare = Bare(args, size, device)
        epochs = s.epochs()

        def door(clock: Clock) -> None:
            next(epochs)
            count = 0
            for x, y in s.batches(data, args.batch):
                loss = step(model, optimizer, x, y)
                s.log(loss=loss.detach())
                count += 1
            clock.stop(count)

        rows = timed({"bare": bare.run, "session": door}, args.runs, cuda, {"session": Writes(s._rt)})
        table = profiled(door, cuda)
        bare.close()
        for _ in epochs:  # the session's remaining epochs: none run, the loop ends as a script's does
            break
    return rows, table


# The items: the service's functions a step calls, by file and function name. Each item's figure is the cumulative
# time of its functions when called from outside the item (a nested call inside the item counts once), less the
# other items it calls; OWN items count only their own code (the DDP wrapper: DDP's forward is the bare loop's too).
ITEMS: dict[str, tuple[tuple[str, str], ...]] = {
    "seeding": (("loop/stepping.py", "seed_step"),),
    "counting (state, plan)": (("loop/stepping.py", "count_step"),),
    "log window (s.log, step, report)": (("loop/window.py", "*"), ("loop/runtime.py", "log")),
    "sinks: Prometheus": (("telemetry/prometheus.py", "*"),),
    "sinks: TensorBoard": (("telemetry/metrics.py", "TensorBoardSink"),),
    "sinks: log line, fan-out, goodput": (("telemetry/metrics.py", "*"), ("telemetry/goodput.py", "*")),
    "trace (off: a null object)": (("data/loaders.py", "record"),),
    "progress marks (boundary)": (("telemetry/progress.py", "stepped"), ("telemetry/progress.py", "mark")),
    "forward marks (watchdog)": (
        ("telemetry/progress.py", "forward_started"),
        ("telemetry/progress.py", "forward_done"),
    ),
    "DDP wrapper's own code": (("model/wrapped.py", "forward"),),
    "task step: non-finite guard, clip (bare clips too)": (("model/nonfinite.py", "*"),),
    "task step: LR schedule": (("torch/optim/lr_scheduler.py", "step"),),
    "task step: its own code (train.py)": (("loop/train.py", "optimizer_step"),),
    "preemption check": (("state/preemption.py", "*"),),
    "save_due (checkpoint, snapshot)": (("loop/runtime.py", "save_due"),),
    "writes: snapshot capture, checkpoint save": (
        ("state/snapshot.py", "capture"),
        ("state/checkpoint.py", "maybe_save"),
        ("bench/boundary.py", "timed_capture"),
        ("bench/boundary.py", "timed_save"),
    ),  # fmt: skip
    "comm hook (main thread part)": (("telemetry/commtiming.py", "*"),),
    "data path (plan, collate, to device)": (
        ("data/feeds.py", "*"),
        ("data/sampler.py", "*"),
        ("data/batches.py", "*"),
        ("data/dataset_feed.py", "*"),
    ),  # fmt: skip
}


OWN = {"DDP wrapper's own code", "task step: its own code (train.py)"}


def _classes() -> dict[tuple[str, str], str]:
    """(file, function name) -> class name for the sink classes, so that a method is told apart by its class."""
    import inspect

    from service.telemetry import metrics, prometheus

    found = {}
    for cls in (prometheus.PrometheusSink, metrics.TensorBoardSink):
        for function in vars(cls).values():
            if inspect.isfunction(function):
                found[(function.__code__.co_filename, str(function.__code__.co_firstlineno))] = cls.__name__
    return found


def items(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """µs per step of each item (see ITEMS), each function given to the first item that names it."""
    classes = _classes()
    raw: dict[tuple[str, int, str], tuple] = stats.stats  # type: ignore[attr-defined]

    def item_of(key: tuple[str, int, str]) -> str | None:
        filename, line, name = key
        where = filename.replace(os.sep, "/")
        if "/service/" in where:
            path = where.split("/service/", 1)[1]
        elif "/torch/" in where:
            path = "torch/" + where.rsplit("/torch/", 1)[1]
        elif where.endswith("/bench/boundary.py"):
            path = "bench/boundary.py"  # the Writes timers around the writes
        else:
            return None
        owner = classes.get((filename, str(line)))
        for item, patterns in ITEMS.items():
            for file, function in patterns:
                if path == file and function in ("*", name, owner):
                    return item
        return None

    totals = dict.fromkeys(ITEMS, 0.0)
    for key, (_, _, own, _, callers) in raw.items():
        item = item_of(key)
        if item is None:
            continue
        if item in OWN:
            totals[item] += own
            continue
        for caller, timing in callers.items():
            if item_of(caller) != item:  # a call into the item from outside it
                totals[item] += timing[3]
    # An item's figure holds the items it calls (count_step calls the window, the sinks, the marks): take them out.
    nested = dict.fromkeys(ITEMS, 0.0)
    for key, (_, _, _, _, callers) in raw.items():
        item = item_of(key)
        for caller, timing in callers.items():
            outer = item_of(caller)
            if item is not None and outer is not None and outer != item and outer not in OWN:
                nested[outer] += timing[3]
    return {item: (totals[item] - nested[item]) / steps * 1e6 for item in ITEMS}


def spread(values: list[float]) -> str:
    middle = statistics.median(values)
    return f"{middle:8.1f}" + (f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else "")


def per_run(rows: list[dict], door: str, key: str, minus: str | None = None) -> list[float]:
    """µs per step of ``door`` in each run (less ``minus``'s in the same run)."""
    by = {(row["door"], row["run"]): row for row in rows}
    runs = sorted({row["run"] for row in rows})
    return [(by[door, run][key] - (by[minus, run][key] if minus else 0.0)) * 1e6 for run in runs]


def report(world: int, results: dict[str, dict]) -> None:
    """One world size's table: per door the µs per step (median over the runs, their range), then the items."""
    device = next(iter(results.values()))["device"]
    print(f"\nworld {world} on {device}: µs per step, median over the runs (min-max)")
    print(f"{'door':<12}{'wall':>22}{'main-thread CPU':>24}{'process CPU':>24}{'main CPU over bare':>24}")
    for job in results.values():
        rows = job["rows"]
        doors = list(dict.fromkeys(row["door"] for row in rows))
        for door in doors:
            over = spread(per_run(rows, door, "thread", "bare")) if door != "bare" else ""
            cells = (spread(per_run(rows, door, key)) for key in ("wall", "thread", "process"))
            print(f"{door:<12}" + "".join(f"{cell:>24}" for cell in cells) + f"{over:>24}")
        for door in doors:
            if door == "bare":
                continue
            writes = per_run(rows, door, "writes")
            between = [over - write for over, write in zip(per_run(rows, door, "thread", "bare"), writes, strict=True)]
            snapshots = statistics.median(row["snapshots"] for row in rows if row["door"] == door)
            checkpoints = statistics.median(row["checkpoints"] for row in rows if row["door"] == door)
            print(f"{'':<12}{door}: its writes (rank 0: {snapshots:.0f} snapshot captures, {checkpoints:.0f} "
                  f"checkpoints a run) {spread(writes).strip()} µs per step of main-thread CPU; over bare between "
                  f"its writes: {spread(between).strip()} µs per step")  # fmt: skip
        if "task -hook" in doors:
            hook = spread(per_run(rows, "task", "process", "task -hook")).strip()
            print(f"{'':<12}metrics.allreduce_timing (the comm hook, DDP's pre-forward timers, two histograms), "
                  f"process CPU (task - task -hook, run by run): {hook} µs per step")  # fmt: skip
    doors = list(results)
    # The profiler's own cost (a clock read per call and return) inflates every item; "scaled" divides it out
    # evenly: each item times the door's CPU without the profiler over its CPU with it. An estimate, not a reading.
    scale = {}
    for door, job in results.items():
        scale[door] = statistics.median(per_run(job["rows"], door, "thread")) / job["items"][PROFILED]
    print(f"\nworld {world}: items, main-thread CPU µs per step under cProfile, one epoch (scaled: times the door's "
          "CPU without the profiler over with it)")  # fmt: skip
    print(f"{'item':<52}" + "".join(f"{door:>10}{'scaled':>8}" for door in doors))
    for item in [*ITEMS, PROFILED]:
        cells = "".join(
            f"{results[d]['items'][item]:>10.1f}{results[d]['items'][item] * scale[d]:>8.1f}" for d in doors
        )
        print(f"{item:<52}{cells}")
    sums = (sum(value for key, value in results[d]["items"].items() if key != PROFILED) for d in doors)
    print(f"{'sum of the items':<52}" + "".join(f"{value:>10.1f}{'':>8}" for value in sums))
    over = []
    for door, job in results.items():
        extra = statistics.median(per_run(job["rows"], door, "thread", "bare"))
        writes = statistics.median(per_run(job["rows"], door, "writes"))
        bare = statistics.median(per_run(job["rows"], "bare", "wall")) / 1e3
        walls = zip(per_run(job["rows"], "bare", "wall"), per_run(job["rows"], door, "wall"), strict=True)
        ratio = statistics.median(bare_wall / door_wall for bare_wall, door_wall in walls)
        over.append(f"{door} {extra:+.0f} µs, {extra - writes:+.0f} between writes, wall {ratio:.3f} of bare's "
                    f"(bare step {bare:.2f} ms)")  # fmt: skip
    print(f"boundary world {world} on {device}: main-thread CPU per step over bare: {', '.join(over)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="steps per epoch of each door (one run)")
    parser.add_argument("--runs", type=int, default=1, help="timed runs of each door (5: the spread over 5)")
    parser.add_argument("--worlds", default="1,2", help="gloo process counts, comma-separated")
    parser.add_argument("--batch", type=int, default=1, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=1, help="the model: layers x Linear(width, width)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--doors", default="task,session", help="the service's doors to run, each against bare")
    parser.add_argument(
        "--exporter",
        choices=["on", "off"],
        default="on",
        help="on: metrics.port=auto (Prometheus, the comm hook); off: the config's default, port 0",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--worker", choices=["task", "session"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("steps", "runs", "batch", "width", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1; got {getattr(args, name)}.")
    if args.worker:
        worker(args)
        return
    from paired import launch

    try:
        worlds = [int(world) for world in args.worlds.split(",") if world]
    except ValueError:
        parser.error(f"--worlds takes process counts separated by commas (1,2); got {args.worlds!r}.")
    passed = ["--steps", str(args.steps), "--runs", str(args.runs), "--batch", str(args.batch), "--width",
              str(args.width), "--layers", str(args.layers), "--exporter", args.exporter,
              *(item for override in args.set for item in ("--set", override))]  # fmt: skip
    print(
        f"{args.steps} steps a run, {args.runs} run(s), batch {args.batch}, model {args.layers} x Linear"
        f"({args.width}, {args.width}); {' '.join(args.set) or 'the defaults'} "
        f"({'metrics.port=auto' if args.exporter == 'on' else 'no exporter: metrics.port=0'})"
    )
    for world in worlds:
        results = {door: launch(__file__, world, [door, *passed], f"{door} run")
                   for door in args.doors.split(",") if door}  # fmt: skip
        report(world, results)


if __name__ == "__main__":
    main()
