"""Where a session step's extra CPU goes (world 1 in one process, or under torchrun): the loop's ``next()``
against the step's body, and the boundary's functions one by one.

``bench/boundary.py`` gives the totals over the bare loop; its cProfile items over-read call-dense code and left
about 100 µs a step that no item held. This bench measures without a profiler, in main-thread CPU
(``time.thread_time``):

- ``--mode cross`` (default): the bare loop (DDP, DistributedSampler, DataLoader) and the session loop
  (``s.model``, ``s.batches``, ``s.log``), each step split into the time inside the loop's ``next()`` (the data and,
  for the session, the step boundary) and the body (forward, backward, clip, SGD, ``s.log``); and the two crossed
  (the session's model on the bare loader; the bare model in ``s.batches``), which tells the model wrapper's share
  of the body from the boundary's. The doors run in turn, the order flipped every round.
- ``--mode functions``: the session loop alone, the boundary's functions each wrapped in a CPU timer (a wrapper
  costs itself about 1 µs a call: the ``nop wrapper`` row); nested wrappers count in their caller too.

    python bench/boundary_split.py [--mode cross|functions] [--steps 2000] [--rounds 10] [--set KEY=VALUE ...]
    torchrun --standalone --nproc_per_node=2 bench/boundary_split.py ...   # world 2: rank 0 prints

The config's defaults (no exporter, the watchdog, snapshots at ``auto``, TensorBoard, a log line every 10 steps)
but ``checkpoint.every_steps=0``: periodic checkpoints are writes, which ``bench/boundary.py`` times apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]  # this tree's service

CPU = time.thread_time
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def say(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)


def dataset(size: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    return TensorDataset(*(torch.randn(1, 1, generator=generator).expand(size, 1) for _ in range(2)))


def epoch(model: Any, optimizer: Any, batches: Iterator[Any], log: Callable[..., None] | None) -> tuple[float, ...]:
    """One epoch: µs per step inside ``next()``, in the body, and in all."""
    import torch

    inside_next = body = 0.0
    steps = 0
    began = CPU()
    while True:
        asked = CPU()
        try:
            x, y = next(batches)
        except StopIteration:
            break
        got = CPU()
        inside_next += got - asked
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log is not None:
            log(loss=loss.detach())
        body += CPU() - got
        steps += 1
    return tuple(value / max(steps, 1) * 1e6 for value in (inside_next, body, CPU() - began))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["cross", "functions"], default="cross")
    parser.add_argument("--steps", type=int, default=2000, help="steps an epoch")
    parser.add_argument("--rounds", type=int, default=10, help="epochs of each door")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    args = parser.parse_args(argv)
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    import service

    tmp = tempfile.mkdtemp()
    sets = [f"run_dir={tmp}", "checkpoint.resume=never", "train.batch_size=1", "train.epochs=100000",
            "checkpoint.every_steps=0", *args.set]  # fmt: skip
    with service.Session(overrides=sets) as s:
        torch.manual_seed(0)
        model = s.model(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        s.keep(model=model, optimizer=optimizer)
        data = dataset(args.steps)
        epochs = s.epochs()
        torch.manual_seed(0)
        bare_model = DistributedDataParallel(torch.nn.Linear(1, 1))
        bare_optimizer = torch.optim.SGD(bare_model.parameters(), lr=0.01)
        sampler = DistributedSampler(data, seed=0)
        loader = DataLoader(data, batch_size=1, sampler=sampler, drop_last=True)
        bare_epochs = iter(range(10**9))

        def bare_batches() -> Iterator[Any]:
            sampler.set_epoch(next(bare_epochs))
            return iter(loader)

        def session_batches() -> Iterator[Any]:
            next(epochs)
            return iter(s.batches(data, 1))

        if args.mode == "cross":
            doors = {
                "bare": lambda: epoch(bare_model, bare_optimizer, bare_batches(), None),
                "session": lambda: epoch(model, optimizer, session_batches(), s.log),
                "session's model, bare loader": lambda: epoch(model, optimizer, bare_batches(), None),
                "bare model, s.batches + s.log": lambda: epoch(bare_model, bare_optimizer, session_batches(), s.log),
            }
            cross(doors, args)
        else:
            functions(s, lambda: epoch(model, optimizer, session_batches(), s.log), args)
        for _ in epochs:  # the remaining epochs: none run, the loop ends as a script's does
            break


def cross(doors: dict[str, Callable[[], tuple[float, ...]]], args: argparse.Namespace) -> None:
    for door in doors.values():
        door()  # warm
    names = list(doors)
    rows: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            rows[name].append(doors[name]())
    say(f"\nworld {WORLD}, {args.steps} steps x {args.rounds} rounds: main-thread CPU µs a step, median (its "
        "difference to bare in the same round: median, min..max)")  # fmt: skip
    for name in names:
        cells = []
        for index, part in enumerate(("next()", "body", "total")):
            own = [row[index] for row in rows[name]]
            over = [row[index] - bare[index] for row, bare in zip(rows[name], rows["bare"], strict=True)]
            cells.append(f"{part} {statistics.median(own):6.1f} ({statistics.median(over):+6.1f}, "
                         f"{min(over):+.0f}..{max(over):+.0f})")  # fmt: skip
        say(f"  {name:<31}" + "  ".join(cells))


def functions(s: Any, door: Callable[[], tuple[float, ...]], args: argparse.Namespace) -> None:
    from service.data import batches
    from service.loop import stepping
    from service.telemetry.progress import Progress

    spent: dict[str, float] = {}

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        spent[name] = 0.0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = CPU()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += CPU() - began

        return wrapper

    rt = s._rt
    nop = timed("nop wrapper (a wrapper's own cost)", lambda: None)
    stepping._boundary = timed("_boundary (all below but seed_step, to_device, s.log)", stepping._boundary)
    stepping.seed_step = timed("seed_step", stepping.seed_step)
    stepping.count_step = timed("count_step (window.step, sink.on_step, trace, ...)", stepping.count_step)
    rt.roles.sink.on_step = timed("  sink.on_step", rt.roles.sink.on_step)
    rt.window.report = timed("window.report (every log_every steps)", rt.window.report)
    rt.roles.sink.on_report = timed("sink.on_report (log line, TensorBoard, gauges)", rt.roles.sink.on_report)
    rt.preemption.stop_now = timed("preemption.stop_now", rt.preemption.stop_now)
    rt.kept.check_loadable = timed("kept.check_loadable", rt.kept.check_loadable)
    rt.save_due = timed("save_due (snapshot schedule and captures)", rt.save_due)
    Progress.mark = timed("progress.mark", Progress.mark)  # type: ignore[method-assign]
    batches.to_device = timed("to_device (s.batches)", batches.to_device)
    s._stepped = timed("the session's stepped hook", s._stepped)
    log = s.log
    s.log = timed("s.log (in the body)", log)

    def with_nop() -> tuple[float, ...]:
        got = door()
        for _ in range(args.steps):
            nop()
        return got

    with_nop()  # warm
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name in spent:
            spent[name] = 0.0
        inside_next, body, _total = with_nop()
        rows.setdefault("next() in all", []).append(inside_next)
        rows.setdefault("body in all", []).append(body)
        for name, seconds in spent.items():
            rows.setdefault(name, []).append(seconds / args.steps * 1e6)
    say(f"\nworld {WORLD}, the session, {args.steps} steps x {args.rounds} rounds: main-thread CPU µs a step by "
        "function, median (min-max)")  # fmt: skip
    for name, values in rows.items():
        say(f"  {name:<60}{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
