"""Where training numbers go: log lines, the progress bar, TensorBoard (Prometheus: ``prometheus.py``).

Every destination is a :class:`MetricsSink`. Which ranks get which sinks is
decided once (see ``roles.py``); the loop calls one fan-out sink and never asks
for its rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("service.loop.train")


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One logging window's numbers: this rank's own (``loss``, ``rank_samples_per_second``: TensorBoard and
    Prometheus, per rank) and the world's (``world_loss``, ``world_samples_per_second``: the log line).

    ``values``/``world_values``: every scalar the loop logged in the window (``loss`` among them for a task; a
    script's own names through ``s.log``), this rank's mean and the world's; ``loss`` and ``world_loss`` are
    their ``loss`` (None when nothing of that name was logged), ``lr`` the first optimizer's (None without one).
    """

    global_step: int
    total_steps: int
    epoch: int
    loss: float | None
    lr: float | None
    samples_seen: int
    rank_samples_per_second: float
    world_loss: float | None  # the mean over every rank's steps of the window
    world_samples_per_second: float  # the ranks' throughputs summed
    seconds_per_step: float  # this rank's wall time per step in the window (the ETA)
    values: Mapping[str, float] = dataclasses.field(default_factory=dict)
    world_values: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _scalars(loss: float | None, values: Mapping[str, float]) -> str:
    named = ([f"loss {loss:.4f}"] if loss is not None else []) + [
        f"{name} {value:.4g}" for name, value in values.items() if name != "loss"
    ]
    return " ".join(named)


def format_step(report: StepReport, own: bool = False) -> str:
    """The log line of a log step: the world's loss (and every other logged scalar) and throughput, and the time
    left at this window's pace; ``own``: this rank's own after them."""
    left = max(0, report.total_steps - report.global_step) * report.seconds_per_step
    scalars = _scalars(report.world_loss, report.world_values)
    lr = f"lr {report.lr:.5f} " if report.lr is not None else ""
    line = (
        f"step {report.global_step}/{report.total_steps} epoch {report.epoch} {scalars}{' ' if scalars else ''}"
        f"{lr}samples/s {report.world_samples_per_second:.1f} eta {datetime.timedelta(seconds=round(left))}"
    )
    if own:
        mine = _scalars(report.loss, report.values)
        line += f" | this rank: {mine}{' ' if mine else ''}samples/s {report.rank_samples_per_second:.1f}"
    return line


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """Each eval value's mean over the whole eval set; ``metric_name`` is the headline one (the task's metric)."""

    epoch: int
    global_step: int
    metrics: Mapping[str, float]
    metric_name: str

    @property
    def loss(self) -> float | None:
        return self.metrics.get("loss")

    @property
    def metric(self) -> float:
        return self.metrics[self.metric_name]


class MetricsSink:
    """Do-nothing defaults: a sink overrides only what it records."""

    def instrument(self, model: Any) -> None:
        """Called once before training with the wrapped model (e.g. to time DDP's all-reduce)."""

    def on_step(self, rank_samples: int, step_seconds: float = 0.0, data_wait_seconds: float = 0.0,
                tokens: int = 0) -> None:  # fmt: skip
        """Called every optimizer step with host-timer numbers: no sync, no I/O, no collective; keep it cheap.

        ``rank_samples``: real samples (no fillers) this rank consumed; ``step_seconds``: wall time of the
        step, data wait included; ``data_wait_seconds``: time blocked in the loader; ``tokens``: 0 unless the
        task counts them.
        """

    def on_checkpoint(self, seconds: float, ok: bool) -> None:
        """Called by the checkpointer (rank 0, maybe from its writer thread) after each save attempt."""

    def on_checkpoint_stall(self, seconds: float) -> None:
        """Called after every step's checkpoint and snapshot calls with the time they held the training thread
        (a background write's time is not in it; ``on_checkpoint`` has that)."""

    def on_report(self, report: StepReport) -> None:
        """Called every ``train.log_every`` steps."""

    def on_plan(self, total_steps: int) -> None:
        """Called once the loop knows how many optimizer steps the run has (its data is known)."""

    def on_eval(self, report: EvalReport, seconds: float = 0.0) -> None:
        """Called after each evaluation; ``seconds``: its wall time (a host timer)."""

    def on_hang(self, behind_rank: int) -> None:
        """Called by the hang watchdog's thread, just before the process exits; ``behind_rank``: -1 if unknown."""

    def close(self) -> None:
        """Release files, threads and ports."""


def overrides(sink: MetricsSink, method: str) -> bool:
    """Does ``sink`` record ``method``'s event (its class or the object itself replaces the do-nothing default)?"""
    return getattr(getattr(sink, method), "__func__", None) is not getattr(MetricsSink, method)


class NullSink(MetricsSink):
    """Records nothing; what ranks without a destination get."""


class FanOutSink(MetricsSink):
    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = tuple(sinks)
        # The sinks that record each step: a do-nothing default is not called at every step.
        self.stepping = tuple(sink for sink in self.sinks if overrides(sink, "on_step"))
        self.stalling = tuple(sink for sink in self.sinks if overrides(sink, "on_checkpoint_stall"))

    def instrument(self, model: Any) -> None:
        for sink in self.sinks:
            sink.instrument(model)

    def on_step(self, rank_samples: int, step_seconds: float = 0.0, data_wait_seconds: float = 0.0,
                tokens: int = 0) -> None:  # fmt: skip
        for sink in self.stepping:
            sink.on_step(rank_samples, step_seconds, data_wait_seconds, tokens)

    def on_checkpoint(self, seconds: float, ok: bool) -> None:
        for sink in self.sinks:
            sink.on_checkpoint(seconds, ok)

    def on_checkpoint_stall(self, seconds: float) -> None:
        for sink in self.stalling:
            sink.on_checkpoint_stall(seconds)

    def on_report(self, report: StepReport) -> None:
        for sink in self.sinks:
            sink.on_report(report)

    def on_plan(self, total_steps: int) -> None:
        for sink in self.sinks:
            sink.on_plan(total_steps)

    def on_eval(self, report: EvalReport, seconds: float = 0.0) -> None:
        for sink in self.sinks:
            sink.on_eval(report, seconds)

    def on_hang(self, behind_rank: int) -> None:
        for sink in self.sinks:
            sink.on_hang(behind_rank)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class LogSink(MetricsSink):
    """Plain log lines (:func:`format_step`); the logging formatter adds the rank prefix.

    Every rank has one, and the logger's level decides who prints (rank 0 alone
    unless ``logging.all_ranks``); ``own`` adds the rank's own numbers to the line.
    """

    def __init__(self, own: bool = False) -> None:
        self.own = own

    def on_report(self, report: StepReport) -> None:
        if log.isEnabledFor(logging.INFO):  # the line is built only where it prints (rank 0 by default)
            log.info("%s", format_step(report, self.own))

    def on_eval(self, report: EvalReport, seconds: float = 0.0) -> None:
        values = " ".join(f"{name} {value:.4f}" for name, value in report.metrics.items())
        log.info("eval epoch %d step %d %s", report.epoch, report.global_step, values)


def progress_sink(total_steps: int | None, terminal: bool) -> MetricsSink:
    """Rank 0's progress: a tqdm bar on a terminal; elsewhere (a file, a pipe, a pod's log) none, since the
    log line of each log step already says the step, the total and the time left, without carriage returns."""
    return ProgressSink(total_steps) if terminal else NullSink()


class ProgressSink(MetricsSink):
    """A tqdm bar over optimizer steps on a terminal (rank 0 only, or every rank would draw one).

    While it lives, the ``service`` loggers write through ``tqdm.write``, so log
    lines print above the bar instead of through it.
    """

    def __init__(self, total_steps: int | None) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=False)
        self.redirect = contextlib.ExitStack()
        loggers = [logging.getLogger(name) for name in ("service", "py.warnings")]
        self.redirect.enter_context(logging_redirect_tqdm([logger for logger in loggers if logger.handlers]))

    def on_step(self, rank_samples: int, step_seconds: float = 0.0, data_wait_seconds: float = 0.0,
                tokens: int = 0) -> None:  # fmt: skip
        self.bar.update(1)

    def on_report(self, report: StepReport) -> None:
        if report.world_loss is not None:
            self.bar.set_postfix(loss=f"{report.world_loss:.4f}", refresh=False)

    def on_plan(self, total_steps: int) -> None:
        self.bar.total = total_steps

    def close(self) -> None:
        self.redirect.close()
        self.bar.close()


class TensorBoardSink(MetricsSink):
    """One event dir per rank: ``run_dir/tensorboard/rank{N}`` (a shared dir raises FileExistsError)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def on_report(self, report: StepReport) -> None:
        """The report's scalars in one event (``add_scalar`` builds one per scalar, through numpy: 30 µs each)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        scalars = {"train/loss": report.loss} if report.loss is not None else {}
        scalars.update((f"train/{name}", value) for name, value in report.values.items() if name != "loss")
        if report.lr is not None:
            scalars["train/lr"] = report.lr
        scalars["train/rank_samples_per_second"] = report.rank_samples_per_second
        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), report.global_step)

    def on_eval(self, report: EvalReport, seconds: float = 0.0) -> None:
        for name, value in report.metrics.items():
            self.writer.add_scalar(f"eval/{name}", value, report.global_step)

    def close(self) -> None:
        self.writer.close()
