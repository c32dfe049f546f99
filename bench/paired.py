"""Benches that compare two settings of the task loop epoch for epoch in the same processes (not a bench itself).

On this 2-core VM the speed of a process swings by up to 30% from one start to the next, so a setting that costs a
percent cannot be read from separate ``torchrun`` jobs. These benches build one job per setting (a
:class:`~service.loop.runtime.Runtime` each, in the same processes and process group) and run one epoch of each in
turn, the order flipped every epoch (ABBA), so drift on the machine hits both alike:

- :func:`launch` runs a bench script's ``--worker`` under ``torchrun --standalone`` and returns what its rank 0 wrote;
- :func:`runtimes` opens the jobs of a worker, one per setting;
- :func:`alternate` times their epochs, each the task loop's own steps (:func:`task_epoch`).

Used by ``bench/metrics_overhead.py`` (metrics, the goodput ledger) and ``bench/snapshot_overhead.py`` (in-memory
snapshots); ``bench/overhead.py`` pairs the task loop with a bare loop the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

Timed = dict  # one timed epoch of one job: {"seconds": wall seconds, "steps": optimizer steps}


def launch(script: str | Path, nproc: int, args: Sequence[str], what: str = "benchmark") -> Any:
    """``script --worker ARGS --out FILE`` under ``torchrun --standalone`` with ``nproc`` processes (this tree's
    service first on the path); the JSON its rank 0 wrote to FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), "--worker", *args, "--out", str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"The {what} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        return json.loads(out.read_text())


@contextlib.contextmanager
def runtimes(overrides: Mapping[str, Sequence[str]]) -> Iterator[dict[str, Any]]:
    """One job per setting (``overrides``: its config overrides by name, each with a run_dir of its own), in one
    process group under torchrun; the jobs close before the group does."""
    from service.config import load_config
    from service.loop.runtime import Runtime
    from service.state.preemption import Preemption
    from service.world.distributed import distributed
    from service.world.env import detect_world

    world = detect_world(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        configs = {name: load_config(None, [*sets, f"run_dir={tmp}/{name}"]) for name, sets in overrides.items()}
        first = next(iter(configs.values()))
        with distributed(world, first.dist.backend, first.dist.timeout_seconds) as ctx:
            opened = {name: Runtime(config, world, ctx, Preemption()) for name, config in configs.items()}
            try:
                yield opened
            finally:  # the models go before the process group
                for runtime in opened.values():
                    runtime.close()


def task_epoch(runtime, job, hooks, body=contextlib.nullcontext):  # noqa: ANN001, ANN201 - service objects
    """One epoch of the task loop's steps, as ``ddp-service train`` runs them (``body`` wraps each step's body);
    returns the steps run."""
    from service.loop.stepping import steps
    from service.loop.train import optimizer_step

    count = 0
    for fed in steps(runtime, job.feed, hooks, one_epoch=True):
        with body():
            loss = optimizer_step(job, fed.plan, fed.batches, runtime.state.global_step + 1)
        runtime.log({"loss": loss})
        count += 1
    return count


def alternate(opened: Mapping[str, Any], epochs: int,
              settle: Callable[[str], None] = lambda name: None) -> dict[str, list[Timed]]:  # fmt: skip
    """``epochs`` epochs of each job, one of each in turn, the order flipped every epoch. ``settle(name)`` runs
    inside the job's timed epoch, after its steps: work the job started and has not finished counts to it, not to
    the next epoch of the other."""
    import torch.distributed as dist

    from service.loop.stepping import Hooks
    from service.loop.train import build_job

    jobs = {name: build_job(runtime) for name, runtime in opened.items()}
    hooks = {name: Hooks(stepped=job.nonfinite.check, epoch_start=job.model.train) for name, job in jobs.items()}
    names = list(opened)
    timed: dict[str, list[Timed]] = {name: [] for name in names}
    for epoch in range(epochs):
        for name in names if epoch % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            count = task_epoch(opened[name], jobs[name], hooks[name])
            settle(name)
            timed[name].append({"seconds": time.perf_counter() - start, "steps": count})
    return timed
