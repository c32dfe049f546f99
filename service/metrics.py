"""Where training numbers go: log lines, the progress bar, TensorBoard, Prometheus.

Every destination is a :class:`MetricsSink`. Which ranks get which sinks is
decided once (see ``roles.py``); the loop calls one fan-out sink and never asks
for its rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("service.train")


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One logging window's numbers, from this rank's point of view."""

    global_step: int
    total_steps: int
    epoch: int
    loss: float
    lr: float
    samples_seen: int
    rank_samples_per_second: float


@dataclasses.dataclass(frozen=True)
class EvalReport:
    epoch: int
    global_step: int
    loss: float
    metric_name: str
    metric: float


class MetricsSink:
    """Do-nothing defaults: a sink overrides only what it records."""

    def on_step(self, rank_samples: int) -> None:
        """Called every optimizer step with the samples this rank consumed; keep it cheap."""

    def on_report(self, report: StepReport) -> None:
        """Called every ``train.log_every`` steps."""

    def on_eval(self, report: EvalReport) -> None:
        """Called after each evaluation."""

    def close(self) -> None:
        """Release files, threads and ports."""


class NullSink(MetricsSink):
    """Records nothing; what ranks without a destination get."""


class FanOutSink(MetricsSink):
    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = tuple(sinks)

    def on_step(self, rank_samples: int) -> None:
        for sink in self.sinks:
            sink.on_step(rank_samples)

    def on_report(self, report: StepReport) -> None:
        for sink in self.sinks:
            sink.on_report(report)

    def on_eval(self, report: EvalReport) -> None:
        for sink in self.sinks:
            sink.on_eval(report)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class LogSink(MetricsSink):
    """Plain log lines; the logging formatter adds the rank prefix."""

    def on_report(self, report: StepReport) -> None:
        log.info(
            "step %d/%d epoch %d loss %.4f lr %.5f samples/s %.1f",
            report.global_step, report.total_steps, report.epoch, report.loss, report.lr,
            report.rank_samples_per_second,
        )  # fmt: skip

    def on_eval(self, report: EvalReport) -> None:
        log.info("eval epoch %d step %d loss %.4f %s %.4f", report.epoch, report.global_step,
                 report.loss, report.metric_name, report.metric)  # fmt: skip


class ProgressSink(MetricsSink):
    """A tqdm bar over optimizer steps (rank 0 only, or every rank would draw one)."""

    def __init__(self, total_steps: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=False)

    def on_step(self, rank_samples: int) -> None:
        self.bar.update(1)

    def on_report(self, report: StepReport) -> None:
        self.bar.set_postfix(loss=f"{report.loss:.4f}", refresh=False)

    def close(self) -> None:
        self.bar.close()


class TensorBoardSink(MetricsSink):
    """One event dir per rank: ``run_dir/tensorboard/rank{N}`` (a shared dir raises FileExistsError)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def on_report(self, report: StepReport) -> None:
        self.writer.add_scalar("train/loss", report.loss, report.global_step)
        self.writer.add_scalar("train/lr", report.lr, report.global_step)
        self.writer.add_scalar("train/rank_samples_per_second", report.rank_samples_per_second, report.global_step)

    def on_eval(self, report: EvalReport) -> None:
        self.writer.add_scalar("eval/loss", report.loss, report.global_step)
        self.writer.add_scalar(f"eval/{report.metric_name}", report.metric, report.global_step)

    def close(self) -> None:
        self.writer.close()


class PrometheusSink(MetricsSink):
    """Per-rank metrics on ``host:port``; each rank serves its own registry."""

    def __init__(self, host: str, port: int, labels: dict[str, str]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        names = list(labels)

        def metric(kind, name, doc):  # noqa: ANN001, ANN202 - a local shorthand
            return kind(name, doc, names, registry=self.registry).labels(**labels)

        self.steps = metric(Counter, "ddp_train_steps", "Optimizer steps taken by this rank.")
        self.samples = metric(Counter, "ddp_train_samples", "Training samples consumed by this rank.")
        self.throughput = metric(Gauge, "ddp_train_samples_per_second", "This rank's training throughput.")
        self.loss = metric(Gauge, "ddp_train_loss", "Mean training loss over the last logging window.")
        self.eval_metric = metric(Gauge, "ddp_eval_metric", "The task's eval metric after the last evaluation.")
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                f"The metrics server cannot listen on {host}:{port} ({exc.strerror}). Each rank uses "
                "metrics.port + LOCAL_RANK: pick a base port with enough free ports above it, or 0 to disable."
            ) from exc

    def on_step(self, rank_samples: int) -> None:
        self.steps.inc()
        self.samples.inc(rank_samples)

    def on_report(self, report: StepReport) -> None:
        self.throughput.set(report.rank_samples_per_second)
        self.loss.set(report.loss)

    def on_eval(self, report: EvalReport) -> None:
        self.eval_metric.set(report.metric)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
