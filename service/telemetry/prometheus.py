"""The Prometheus exporter: each rank serves its own registry (``PrometheusSink``), the series' labels and buckets."""

from __future__ import annotations

import logging
import time
from typing import Any

from service.telemetry.commtiming import AllreduceTimer, WaitClock
from service.telemetry.commtiming import instrument as instrument_collectives
from service.telemetry.hangs import NO_HANGS, HangTally
from service.telemetry.metrics import EvalReport, MetricsSink, StepReport
from service.telemetry.series import StepSeries

log = logging.getLogger("service.loop.train")

PREFIX = "ddp_train_"
LABELS = ("rank", "local_rank", "node_rank", "run_id")
# Step, data-wait, all-reduce and checkpoint durations from 1 ms to 60 s.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def metric_labels(world: Any) -> dict[str, str]:
    """The four labels of every series (a ``WorldInfo``); ``job`` and ``instance`` are Prometheus's own."""
    return {"rank": str(world.rank), "local_rank": str(world.local_rank), "node_rank": str(world.node_rank),
            "run_id": world.run_id or "none"}  # fmt: skip


class PrometheusSink(MetricsSink):
    """Per-rank metrics on ``host:port`` (``port`` 0: the OS picks one); each rank serves its own registry.

    Updates come from host timers and values the loop already read: no collective, no device sync, no I/O.
    The HTTP server runs in prometheus-client's thread, so it answers while this rank is inside a long step.
    """

    def __init__(self, host: str, port: int, world: Any, device: str = "cpu", backend: str = "none",
                 base_port: int | str | None = None, allreduce_timing: bool = True,
                 hangs: HangTally = NO_HANGS) -> None:  # fmt: skip
        """``hangs``: what this rank's earlier starts found (``run_dir/hangs.jsonl``), counted on from there."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

        from service.version import __version__

        self.registry = CollectorRegistry()
        self.labels = metric_labels(world)
        names = list(LABELS)

        def metric(kind, name, doc, **kwargs):  # noqa: ANN001, ANN003, ANN202 - a local shorthand
            return kind(PREFIX + name, doc, names, registry=self.registry, **kwargs).labels(**self.labels)

        def histogram(name: str, doc: str) -> Any:
            return metric(Histogram, name, doc, buckets=BUCKETS)

        # What every step updates: plain numbers, read at each scrape (series.py: a lock per update cost 6 µs a step)
        per_step = StepSeries(names, [self.labels[name] for name in names])
        self.samples = per_step.count(PREFIX + "samples", "Training samples this rank consumed (real samples, no "
                                      "fillers).")  # fmt: skip
        self.tokens = per_step.count(
            PREFIX + "tokens", "Training tokens this rank consumed, where the task counts them."
        )
        self.steps = per_step.count(PREFIX + "steps", "Optimizer steps taken by this rank.")
        self.step_seconds = per_step.buckets(PREFIX + "step_seconds", "Wall time of one optimizer step, data wait "
                                             "included.", BUCKETS)  # fmt: skip
        self.data_wait = per_step.buckets(PREFIX + "data_wait_seconds", "Time one optimizer step was blocked waiting "
                                          "for batches.", BUCKETS)  # fmt: skip
        self.allreduce = per_step.buckets(PREFIX + "allreduce_seconds", "Wall time gradient all-reduce was in flight "
                                          "in one step.", BUCKETS)  # fmt: skip
        self.collective_wait = per_step.buckets(PREFIX + "collective_wait_seconds", "Time one step spent in its other "
                                                "collectives: DDP's buffer broadcast and SyncBatchNorm's all-reduces.",
                                                BUCKETS)  # fmt: skip
        self.registry.register(per_step)
        self.loss = metric(Gauge, "loss", "Mean training loss over the last logging window.")
        self.value = Gauge(f"{PREFIX}value", "Each scalar the loop logged (a script's s.log names too), its mean "
                           "over the last logging window, named by label name.", [*names, "name"],
                           registry=self.registry)  # fmt: skip
        self.named: dict[str, Any] = {}  # value's series by name
        self.lr = metric(Gauge, "learning_rate", "The learning rate at the last logging step.")
        self.epoch = metric(Gauge, "epoch", "The epoch being trained (from 0).")
        self.global_step = metric(Gauge, "global_step", "Optimizer steps of the whole run, at the last logging step.")
        self.throughput = metric(Gauge, "samples_per_second", "This rank's training throughput.")
        self.eval_metric = metric(Gauge, "eval_metric", "The task's eval metric after the last evaluation.")
        self.eval_value = Gauge(f"{PREFIX}eval_value", "Each eval value (its mean over the eval set) after the "
                                "last evaluation, named by label metric.", [*names, "metric"],
                                registry=self.registry)  # fmt: skip
        self.checkpoint_seconds = histogram("checkpoint_save_seconds", "Time to write one checkpoint (rank 0).")
        self.checkpoint_last = metric(Gauge, "checkpoint_last_success_timestamp_seconds",
                                      "Unix time of the last successful checkpoint save; 0 before any.")  # fmt: skip
        self.checkpoint_failures = metric(Counter, "checkpoint_failures", "Checkpoint saves that failed.")
        self.hangs = metric(Counter, "hangs", "Hangs this rank's watchdog found in this run_dir (each restarts the "
                            "world), counted across restarts from run_dir/hangs.jsonl.")  # fmt: skip
        self.hangs.inc(hangs.count)
        self.behind_rank = metric(Gauge, "hang_behind_rank", "The rank this rank's watchdog last named as behind "
                                  "in a hang; -1 before any.")  # fmt: skip
        self.behind_rank.set(hangs.behind_rank)
        metric(Gauge, "restarts", "Restarts of the job so far (TORCHELASTIC_RESTART_COUNT).").set(world.restart_count)
        metric(Gauge, "world_size", "Processes in the job's current world.").set(world.world_size)
        import torch

        metric(Info, "build", "Versions and the setup this rank runs with.").info(
            {
                "torch_version": str(torch.__version__),
                "service_version": __version__,
                "backend": backend,
                "device": device,
                "launcher": world.launcher,
            }
        )
        self.cuda = device == "cuda"
        self.max_memory = (
            metric(Gauge, "device_memory_max_allocated_bytes", "torch.cuda.max_memory_allocated at the last log step.")
            if self.cuda
            else None
        )
        self.allreduce_timer = AllreduceTimer() if allreduce_timing else None
        self.wait_clock = WaitClock() if allreduce_timing else None
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            base = port - world.local_rank if base_port is None else base_port
            raise OSError(
                exc.errno,
                f"The metrics server of local rank {world.local_rank} cannot listen on {host}:{port} "
                f"({exc.strerror}): metrics.port={base} and each rank serves on metrics.port + LOCAL_RANK. "
                f"Free port {port}, set metrics.port to a base with {world.local_world_size} free ports above it, "
                "metrics.port=auto to let the OS pick, or 0 to turn the exporter off.",
            ) from exc
        self.port = int(self.server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def instrument(self, model: Any) -> None:
        instrument_collectives(model, self.allreduce_timer, self.wait_clock)

    def on_step(self, rank_samples: int, step_seconds: float = 0.0, data_wait_seconds: float = 0.0,
                tokens: int = 0) -> None:  # fmt: skip
        self.steps.value += 1
        self.samples.value += rank_samples
        if tokens:
            self.tokens.value += tokens
        self.step_seconds.observe(step_seconds)
        self.data_wait.observe(data_wait_seconds)
        if self.allreduce_timer is not None:
            seconds = self.allreduce_timer.take()
            if seconds is not None:
                self.allreduce.observe(seconds)
        if self.wait_clock is not None:
            seconds = self.wait_clock.take()
            if seconds is not None:
                self.collective_wait.observe(seconds)

    def on_report(self, report: StepReport) -> None:
        self.throughput.set(report.rank_samples_per_second)
        if report.loss is not None:
            self.loss.set(report.loss)
        for name, value in report.values.items():
            child = self.named.get(name)
            if child is None:
                child = self.named[name] = self.value.labels(**self.labels, name=name)
            child.set(value)
        if report.lr is not None:
            self.lr.set(report.lr)
        self.epoch.set(report.epoch)
        self.global_step.set(report.global_step)
        if self.max_memory is not None:
            import torch

            self.max_memory.set(torch.cuda.max_memory_allocated())

    def on_eval(self, report: EvalReport, seconds: float = 0.0) -> None:
        self.eval_metric.set(report.metric)
        for name, value in report.metrics.items():
            self.eval_value.labels(**self.labels, metric=name).set(value)

    def on_hang(self, behind_rank: int) -> None:
        self.hangs.inc()
        self.behind_rank.set(behind_rank)

    def on_checkpoint(self, seconds: float, ok: bool) -> None:
        if ok:
            self.checkpoint_seconds.observe(seconds)
            self.checkpoint_last.set(time.time())
        else:
            self.checkpoint_failures.inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
