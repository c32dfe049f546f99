"""What each rank does besides training, decided once, as objects the loop calls blindly."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from service.config import JobConfig
from service.data.loaders import FileSampleTrace, SampleTrace
from service.state.best import BestRule
from service.state.checkpoint import Checkpointer, Rank0Checkpointer
from service.state.resume import Resumed
from service.state.snapshot import Area, Snapshots, build_snapshots
from service.telemetry.goodput import GoodputSink, NoGoodput, StartTimes
from service.telemetry.hangs import FILE as HANGS_FILE
from service.telemetry.hangs import tally
from service.telemetry.metrics import (
    FanOutSink,
    LogSink,
    MetricsSink,
    TensorBoardSink,
    progress_sink,
)
from service.telemetry.prometheus import PrometheusSink
from service.telemetry.summary import JsonSummaryWriter, SummaryWriter
from service.world.env import WorldInfo


class Console:
    """A session's ``s.print`` and ``s.main_first`` on any rank but 0: prints nothing; runs a block after rank 0."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        return None

    @contextlib.contextmanager
    def first(self, wait: Callable[[], None]) -> Iterator[None]:
        wait()
        yield


class LeadConsole(Console):
    """Rank 0's: prints (flushed); runs a ``main_first`` block before the other ranks."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        builtins.print(*args, **{"flush": True, **kwargs})

    @contextlib.contextmanager
    def first(self, wait: Callable[[], None]) -> Iterator[None]:
        yield
        wait()


@dataclasses.dataclass(frozen=True)
class Roles:
    sink: MetricsSink
    checkpointer: Checkpointer
    summary: SummaryWriter
    trace: SampleTrace
    snapshots: Snapshots = dataclasses.field(default_factory=Snapshots)
    goodput: NoGoodput = dataclasses.field(default_factory=NoGoodput)  # rank 0's ledger, also in ``sink``
    console: Console = dataclasses.field(default_factory=Console)  # a session's s.print, s.main_first

    def fence(self, vacant: Callable[[], bool]) -> None:
        """run_dir's lock was lost: no checkpoint there any more, and a summary only while no other job holds it."""
        self.checkpointer.fence()
        self.summary.fence(vacant)

    def close(self) -> None:
        self.snapshots.close()
        self.checkpointer.close()
        self.trace.close()
        self.sink.close()


def build_roles(config: JobConfig, world: WorldInfo, *, config_hash: str, total_steps: int | None = None,
                device_is_cuda: bool = False, resumed: Resumed | None = None,
                lineage: str | None = None, backend: str = "none", terminal: bool = False,
                snapshot_area: Area | None = None, startup: StartTimes | None = None) -> Roles:  # fmt: skip
    """Rank 0 writes checkpoints, the summary, the goodput ledger and the progress bar; every rank logs, exports
    and traces.

    ``terminal``: stderr is a terminal (read once at start): the bar then, else none (the log lines say as much).
    ``total_steps``: None until the loop knows its data (``on_plan`` tells the sinks then).
    Which ranks' log lines print is the logger's level, set at start (:func:`~service.telemetry.logs.log_level`).
    """
    run_dir = Path(config.run_dir)
    is_rank0 = world.rank == 0
    sinks: list[MetricsSink] = [LogSink(own=config.logging.all_ranks)]
    if is_rank0 and config.train.progress_bar:
        sinks.append(progress_sink(total_steps, terminal))
    if config.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard" / f"rank{world.rank}"))
    new_job = config.checkpoint.resume == "never" and resumed is None and world.restart_count == 0
    goodput: NoGoodput = NoGoodput()
    if is_rank0 and config.metrics.goodput and startup is not None:
        goodput = GoodputSink(run_dir, config.metrics.goodput_every_seconds, startup, world.restart_count,
                              world.world_size, fresh=new_job)  # fmt: skip
        sinks.append(goodput)
    base_port = config.metrics.port
    if base_port:
        port = 0 if base_port == "auto" else int(base_port) + world.local_rank
        prometheus = PrometheusSink(config.metrics.host, port, world, "cuda" if device_is_cuda else "cpu",
                                    backend, base_port, config.metrics.allreduce_timing,
                                    tally(run_dir / HANGS_FILE, world.rank))  # fmt: skip
        sinks.append(prometheus)
        goodput.register(prometheus.registry, world.run_id or "none")
    sink = FanOutSink(sinks)
    ckpt = config.checkpoint
    fresh = ckpt.resume == "never" and resumed is None  # never: the job's first start; its restarts resume
    best = BestRule(ckpt.best.metric, ckpt.best.mode) if ckpt.best is not None else None
    checkpointer = (
        Rank0Checkpointer(run_dir / "checkpoints", ckpt.every_steps, ckpt.keep, config_hash, ckpt.on_error,
                          ckpt.async_save, start_fresh=fresh, pin=device_is_cuda,
                          saved_step=resumed.disk_step if resumed else None, resumed=resumed is not None,
                          lineage=lineage, on_save=sink.on_checkpoint, best_rule=best)
        if is_rank0
        else Checkpointer(best)
    )  # fmt: skip
    summary = JsonSummaryWriter(run_dir / "summary.json") if is_rank0 else SummaryWriter()
    trace = FileSampleTrace(run_dir / "trace", world) if config.data.trace else SampleTrace()
    snapshots = build_snapshots(snapshot_area, ckpt.snapshot_every, world.local_rank, config_hash, lineage,
                                device_is_cuda)  # fmt: skip
    return Roles(
        sink=sink,
        checkpointer=checkpointer,
        summary=summary,
        trace=trace,
        snapshots=snapshots,
        goodput=goodput,
        console=LeadConsole() if is_rank0 else Console(),
    )
