"""The Prometheus exporter: the metric set, its labels and buckets, ports, and a real scrape of a running job."""

from __future__ import annotations

import gc
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import kill_group, require_tool, run_job
from prometheus_client.parser import text_string_to_metric_families
from test_resume_e2e import finish, start

from service.config import load_config
from service.loop.roles import build_roles
from service.state.checkpoint import Rank0Checkpointer
from service.state.checkpoint_io import CheckpointWriteError
from service.telemetry.commtiming import AllreduceTimer, WaitClock, instrument
from service.telemetry.metrics import StepReport
from service.telemetry.prometheus import BUCKETS, LABELS, PrometheusSink
from service.world.env import WorldInfo
from service.world.preflight import check_against_world

WORLD = WorldInfo("torchrun", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                  restart_count=2, run_id="job-7")  # fmt: skip
LABEL_VALUES = {"rank": "3", "local_rank": "1", "node_rank": "1", "run_id": "job-7"}

# Every family the exporter serves on CPU (the CUDA memory gauge comes on CUDA only), by Prometheus type.
FAMILIES = {
    "ddp_train_samples": "counter",
    "ddp_train_tokens": "counter",
    "ddp_train_steps": "counter",
    "ddp_train_step_seconds": "histogram",
    "ddp_train_data_wait_seconds": "histogram",
    "ddp_train_allreduce_seconds": "histogram",
    "ddp_train_collective_wait_seconds": "histogram",
    "ddp_train_loss": "gauge",
    "ddp_train_learning_rate": "gauge",
    "ddp_train_epoch": "gauge",
    "ddp_train_global_step": "gauge",
    "ddp_train_samples_per_second": "gauge",
    "ddp_train_eval_metric": "gauge",
    "ddp_train_eval_value": "gauge",
    "ddp_train_value": "gauge",
    "ddp_train_checkpoint_save_seconds": "histogram",
    "ddp_train_checkpoint_last_success_timestamp_seconds": "gauge",
    "ddp_train_checkpoint_failures": "counter",
    "ddp_train_hangs": "counter",
    "ddp_train_hang_behind_rank": "gauge",
    "ddp_train_restarts": "gauge",
    "ddp_train_world_size": "gauge",
    "ddp_train_build": "info",
}


def scrape(port: int, timeout: float = 5) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()


def values(text: str) -> dict[str, float]:
    """Sample name → value for the unlabelled view of one rank's scrape (each name has one series per rank)."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "le" not in sample.labels
    }


def promtool_check(text: str) -> None:
    promtool = require_tool("promtool", "install Debian's `prometheus` package (apt-get install prometheus).")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"promtool check metrics:\n{done.stdout}{done.stderr}\n{text}"


@pytest.fixture
def sink():
    made = PrometheusSink("127.0.0.1", 0, WORLD, backend="gloo")
    yield made
    made.close()


def test_every_eval_value_is_a_series_named_by_its_metric_label(sink):
    from service.telemetry.metrics import EvalReport

    sink.on_eval(EvalReport(epoch=0, global_step=5, metrics={"loss": 0.5, "token_accuracy": 0.75},
                            metric_name="token_accuracy"))  # fmt: skip
    value = sink.registry.get_sample_value
    assert value("ddp_train_eval_metric", LABEL_VALUES) == 0.75
    assert value("ddp_train_eval_value", {**LABEL_VALUES, "metric": "loss"}) == 0.5
    assert value("ddp_train_eval_value", {**LABEL_VALUES, "metric": "token_accuracy"}) == 0.75


def test_the_registry_holds_the_metric_set_with_four_labels_on_every_series(sink):
    families = {family.name: family for family in sink.registry.collect()}
    assert {name: family.type for name, family in families.items()} == FAMILIES
    for family in families.values():
        for sample in family.samples:
            extra = set(sample.labels) - set(LABELS) - {"le"}
            if family.name == "ddp_train_build":
                assert extra == {"torch_version", "service_version", "backend", "device", "launcher"}
            elif family.name == "ddp_train_eval_value":
                assert extra == {"metric"}
            else:
                assert not extra, sample
            assert {key: sample.labels[key] for key in LABELS} == LABEL_VALUES, sample
            assert "job" not in sample.labels and "instance" not in sample.labels
    build = sink.registry.get_sample_value("ddp_train_build_info", {**LABEL_VALUES, "torch_version": torch.__version__,
        "service_version": __import__("service").__version__, "backend": "gloo", "device": "cpu",
        "launcher": "torchrun"})  # fmt: skip
    assert build == 1.0
    assert sink.registry.get_sample_value("ddp_train_restarts", LABEL_VALUES) == 2
    assert sink.registry.get_sample_value("ddp_train_world_size", LABEL_VALUES) == 4
    assert sink.registry.get_sample_value("ddp_train_tokens_total", LABEL_VALUES) == 0
    assert sink.registry.get_sample_value("ddp_train_checkpoint_last_success_timestamp_seconds", LABEL_VALUES) == 0


def test_histograms_span_1ms_to_60s(sink):
    assert BUCKETS[0] == 0.001 and BUCKETS[-1] == 60 and list(BUCKETS) == sorted(BUCKETS)
    for name in (
        "step_seconds",
        "data_wait_seconds",
        "allreduce_seconds",
        "collective_wait_seconds",
        "checkpoint_save_seconds",
    ):
        family = next(f for f in sink.registry.collect() if f.name == f"ddp_train_{name}")
        bounds = [sample.labels["le"] for sample in family.samples if sample.name.endswith("_bucket")]
        assert bounds == [*(str(float(b)) for b in BUCKETS), "+Inf"], (name, bounds)


@pytest.mark.e2e
def test_calls_update_the_registry(sink):
    get = sink.registry.get_sample_value
    sink.on_step(8, 0.2, 0.05)
    sink.on_step(6, 3.0, 0.0005, tokens=30)
    sink.on_report(StepReport(2, 10, 1, 0.5, 0.01, 14, 123.0, world_loss=0.75, world_samples_per_second=500.0,
                              seconds_per_step=0.1))  # fmt: skip
    sink.on_checkpoint(1.5, True)
    sink.on_checkpoint(0.2, False)
    assert get("ddp_train_samples_total", LABEL_VALUES) == 14
    assert get("ddp_train_tokens_total", LABEL_VALUES) == 30
    assert get("ddp_train_steps_total", LABEL_VALUES) == 2
    assert get("ddp_train_step_seconds_count", LABEL_VALUES) == 2
    assert get("ddp_train_step_seconds_sum", LABEL_VALUES) == pytest.approx(3.2)
    assert get("ddp_train_step_seconds_bucket", {**LABEL_VALUES, "le": "0.25"}) == 1
    assert get("ddp_train_data_wait_seconds_bucket", {**LABEL_VALUES, "le": "0.001"}) == 1
    assert get("ddp_train_allreduce_seconds_count", LABEL_VALUES) == 0  # no DDP model instrumented
    assert get("ddp_train_collective_wait_seconds_count", LABEL_VALUES) == 0
    assert get("ddp_train_loss", LABEL_VALUES) == 0.5
    assert get("ddp_train_learning_rate", LABEL_VALUES) == 0.01
    assert get("ddp_train_epoch", LABEL_VALUES) == 1
    assert get("ddp_train_global_step", LABEL_VALUES) == 2
    assert get("ddp_train_samples_per_second", LABEL_VALUES) == 123.0
    assert get("ddp_train_checkpoint_save_seconds_count", LABEL_VALUES) == 1
    assert get("ddp_train_checkpoint_failures_total", LABEL_VALUES) == 1
    assert time.time() - get("ddp_train_checkpoint_last_success_timestamp_seconds", LABEL_VALUES) < 60
    assert get("ddp_train_device_memory_max_allocated_bytes", LABEL_VALUES) is None  # CUDA only
    text = scrape(sink.port)
    assert 'ddp_train_samples_total{local_rank="1",node_rank="1",rank="3",run_id="job-7"} 14.0' in text
    promtool_check(text)


def test_a_step_updates_the_per_step_series_without_prometheus_clients_locked_calls(sink, monkeypatch):
    """Issue 38: every step adds to plain numbers, read at the scrape (prometheus-client's ``inc`` and ``observe``
    take a lock and check their argument at each call: 6 µs a step). The scrape's families are the same: the
    bucket edges (a value on a bound counts under it), sums, counts and ``_created``."""
    import prometheus_client.metrics as client

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a per-step update went through prometheus-client")

    monkeypatch.setattr(client.Counter, "inc", refused)
    monkeypatch.setattr(client.Histogram, "observe", refused)
    for seconds in (0.001, 0.0011, 61.0):
        sink.on_step(2, seconds, 0.0)
    get = sink.registry.get_sample_value
    assert get("ddp_train_steps_total", LABEL_VALUES) == 3 and get("ddp_train_samples_total", LABEL_VALUES) == 6
    assert get("ddp_train_step_seconds_bucket", {**LABEL_VALUES, "le": "0.001"}) == 1
    assert get("ddp_train_step_seconds_bucket", {**LABEL_VALUES, "le": "0.0025"}) == 2
    assert get("ddp_train_step_seconds_bucket", {**LABEL_VALUES, "le": "60.0"}) == 2
    assert get("ddp_train_step_seconds_bucket", {**LABEL_VALUES, "le": "+Inf"}) == 3
    assert get("ddp_train_step_seconds_count", LABEL_VALUES) == 3
    assert get("ddp_train_step_seconds_sum", LABEL_VALUES) == pytest.approx(61.0021)
    assert 0 < time.time() - get("ddp_train_step_seconds_created", LABEL_VALUES) < 60
    assert 0 < time.time() - get("ddp_train_steps_created", LABEL_VALUES) < 60


def test_the_fan_out_calls_at_each_step_only_the_sinks_that_record_steps(tmp_path):
    """Issue 38: a sink with the do-nothing ``on_step`` or ``on_checkpoint_stall`` is not called at every step; one
    whose class or object replaces it is."""
    from service.telemetry.metrics import FanOutSink, LogSink, MetricsSink, NullSink, TensorBoardSink

    class Counting(MetricsSink):
        def on_step(self, *args: object, **kwargs: object) -> None:
            self.steps = getattr(self, "steps", 0) + 1

    own = NullSink()
    own.on_checkpoint_stall = lambda seconds: None  # type: ignore[method-assign]
    counting, board = Counting(), TensorBoardSink(tmp_path / "tb")
    try:
        fan = FanOutSink([LogSink(), NullSink(), board, counting, own])
        assert fan.stepping == (counting,) and fan.stalling == (own,)
        fan.on_step(1, 0.1, 0.0)
        assert counting.steps == 1
    finally:
        board.close()


def test_a_log_line_is_formatted_only_where_it_prints(monkeypatch, caplog):
    """Issue 38: every rank has a log sink, and the other ranks' lines are not printed (WARNING): their line is not
    built either (format_step at each log step)."""
    import logging

    import service.telemetry.metrics as metrics

    built: list[StepReport] = []
    monkeypatch.setattr(metrics, "format_step", lambda report, own=False: built.append(report) or "a line")
    logger = logging.getLogger("service.loop.train")
    monkeypatch.setattr(logger, "level", logging.WARNING)
    metrics.LogSink().on_report(REPORT)
    assert built == []
    monkeypatch.setattr(logger, "level", logging.INFO)
    with caplog.at_level(logging.INFO, logger="service.loop.train"):
        metrics.LogSink().on_report(REPORT)
    assert built == [REPORT] and "a line" in caplog.text


def test_tensorboard_gets_a_reports_scalars_in_one_event(tmp_path):
    """Issue 38: one event per log step (``add_scalar`` built one per scalar, 30 µs each), every scalar in it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from service.telemetry.metrics import TensorBoardSink

    board = TensorBoardSink(tmp_path / "tb")
    board.on_report(StepReport(4, 10, 0, 0.5, 0.01, 8, 100.0, 0.5, 200.0, 0.1, values={"loss": 0.5, "aux": 2.0}))
    board.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = [event for event in EventFileLoader(str(path)).Load() if event.HasField("summary")]
    assert len(events) == 1 and events[0].step == 4
    assert sorted(value.tag for value in events[0].summary.value) == [
        "train/aux", "train/loss", "train/lr", "train/rank_samples_per_second"]  # fmt: skip
    read = EventAccumulator(str(tmp_path / "tb"))
    read.Reload()
    assert [(e.step, e.value) for e in read.Scalars("train/aux")] == [(4, 2.0)]


REPORT = StepReport(2, 10, 1, 0.5, 0.01, 14, 123.0, world_loss=0.75, world_samples_per_second=500.0,
                    seconds_per_step=0.1)  # fmt: skip


def test_run_id_is_none_without_one():
    sink = PrometheusSink("127.0.0.1", 0, WorldInfo("none"))
    try:
        assert sink.labels == {"rank": "0", "local_rank": "0", "node_rank": "0", "run_id": "none"}
    finally:
        sink.close()


def test_a_busy_port_names_the_port_and_metrics_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError) as caught:
            PrometheusSink("127.0.0.1", port, WORLD, base_port=port - 1)
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message and f"metrics.port={port - 1}" in message
    assert "metrics.port + LOCAL_RANK" in message and "metrics.port=auto" in message


def test_port_auto_binds_a_free_port_per_rank_and_logs_it(tmp_path: Path, caplog):
    config = load_config(None, [f"run_dir={tmp_path}", "metrics.port=auto", "metrics.tensorboard=false",
                                "train.progress_bar=false"])  # fmt: skip
    assert config.metrics.port == "auto"
    check_against_world(config, WorldInfo("torchrun", 0, 0, 2, 2))  # no port range to check
    ports = []
    roles = []
    try:
        with caplog.at_level("INFO", logger="service.loop.train"):
            for rank in (0, 1):
                world = WorldInfo("torchrun", rank=rank, local_rank=rank, world_size=2, local_world_size=2)
                roles.append(build_roles(config, world, total_steps=10, config_hash="hash"))
        logged = [int(port) for port in re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", caplog.text)]
        for role in roles:
            (sink,) = [s for s in role.sink.sinks if isinstance(s, PrometheusSink)]  # type: ignore[attr-defined]
            ports.append(sink.port)
            assert "ddp_train_steps_total" in scrape(sink.port)
    finally:
        for role in roles:
            role.close()
    assert len(set(ports)) == 2 and all(ports) and sorted(logged) == sorted(ports)


def test_checkpoint_saves_and_failures_reach_the_sink(sink, tmp_path: Path, monkeypatch):
    get = sink.registry.get_sample_value
    saver = Rank0Checkpointer(tmp_path / "ckpt", 1, 2, "0" * 64, "continue", False, on_save=sink.on_checkpoint)
    saver.save(1, lambda: {"model": {"w": torch.zeros(3)}})
    assert get("ddp_train_checkpoint_save_seconds_count", LABEL_VALUES) == 1
    assert get("ddp_train_checkpoint_last_success_timestamp_seconds", LABEL_VALUES) > 0

    def full_disk(*args: object, **kwargs: object) -> None:
        raise CheckpointWriteError("no space left")

    monkeypatch.setattr("service.state.checkpoint.write_checkpoint", full_disk)
    saver.save(2, lambda: {"model": {"w": torch.zeros(3)}})  # on_error=continue: logged, counted, training goes on
    assert get("ddp_train_checkpoint_failures_total", LABEL_VALUES) == 1


def test_allreduce_timer_times_each_synced_step_of_a_ddp_model(tmp_path: Path):
    """A 1-process gloo group: the hook keeps DDP's numbers and times only steps that all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        timer = AllreduceTimer()
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        model.register_comm_hook(None, timer.hook)
        plain = torch.nn.Linear(4, 2)
        plain.load_state_dict(model.module.state_dict())
        inputs = torch.randn(8, 4)
        model(inputs).sum().backward()
        plain(inputs).sum().backward()
        spans = [timer.take()]
        with model.no_sync():
            model(inputs).sum().backward()
        spans.append(timer.take())
        assert spans[0] is not None and 0 <= spans[0] < 5 and spans[1] is None
        assert torch.allclose(model.module.weight.grad, plain.weight.grad * 2)  # no_sync accumulated once more
        del model
        gc.collect()
    finally:
        dist.destroy_process_group()


class CountingClock(WaitClock):
    def __init__(self) -> None:
        super().__init__()
        self.added: list[float] = []

    def add(self, seconds: float) -> None:
        self.added.append(seconds)
        super().add(seconds)


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "ServiceDDP"])
def test_the_wait_clock_times_the_buffer_broadcast_and_syncbn_but_not_eval(tmp_path: Path, wrapper: str):
    """A 1-process gloo group: DDP's pre-forward and both SyncBatchNorm all-reduces land on the wait clock; the
    service's own DDP times its pre-forward itself, with no forward hook (one would slow every forward)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from service.model.syncbn import AllReduceBatchNorm, convert_sync_batchnorm
    from service.model.wrapped import ServiceDDP

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        kind = ServiceDDP if wrapper == "ServiceDDP" else DistributedDataParallel
        model = kind(convert_sync_batchnorm(net, "cpu"))
        allreduce, waits = AllreduceTimer(), CountingClock()
        instrument(model, allreduce, waits)
        hooked = bool(model._forward_pre_hooks) or bool(model.module._forward_pre_hooks)
        assert hooked == (kind is DistributedDataParallel)
        assert isinstance(model.module[1], AllReduceBatchNorm) and model.module[1].wait_clock is waits
        model(torch.randn(8, 4)).sum().backward()
        # DDP's pre-forward (the buffer broadcast), SyncBatchNorm's two all-reduces in forward and two in backward.
        assert len(waits.added) == 5 and all(seconds >= 0 for seconds in waits.added)
        first = waits.take()
        assert first is not None and first > 0 and waits.take() is None
        assert allreduce.take() is not None
        model.module.eval()
        with torch.no_grad():
            model.module(torch.randn(8, 4))  # evaluation runs the unwrapped model in eval mode: no collective
        assert waits.take() is None
        del model
        gc.collect()
    finally:
        dist.destroy_process_group()


# -- a real job under torchrun --------------------------------------------------------------------------------

# logging.all_ranks: rank 1's "metrics on http://..." line says which port the OS gave it
LONG_JOB = (
    "task=slow_tasks:slow_shapes", "task_options.image_size=16", "task_options.sleep=0.02",
    "task_options.train_size=80", "task_options.eval_size=8", "task_options.tokens_per_sample=3",
    "task_options.long_step_at=6", "task_options.long_step_seconds=5", "task_options.long_step_ranks=[1]",
    "train.batch_size=4", "train.epochs=1", "train.log_every=1", "checkpoint.every_steps=2", "metrics.port=auto",
    "logging.all_ranks=true",
)  # fmt: skip


@pytest.mark.e2e
def test_a_running_job_passes_promtool_and_answers_inside_a_5s_step(tmp_path: Path) -> None:
    """2 ranks, ports picked by the OS; rank 1 sleeps 5 s in step 6 (rank 0 waits for it in the all-reduce).

    Both endpoints answer within 1 s while the step is still running, their scrapes pass
    ``promtool check metrics``, and they hold the whole metric set with this job's numbers.
    """
    promtool_check("")  # skip (or fail in CI) before starting a job when promtool is missing
    proc, watcher = start(tmp_path / "run", 2, *LONG_JOB, start="warm")  # the metrics are the test, not the start
    try:
        watcher.wait_for(r"\[rank 1\] INFO metrics on http://", timeout=120)
        watcher.wait_for(r"\[rank 0\] INFO metrics on http://", timeout=30)
        found = re.findall(r"\[rank (\d)\] INFO metrics on http://127\.0\.0\.1:(\d+)/metrics", watcher.text())
        ports = {int(rank): int(port) for rank, port in found}
        began = watcher.wait_for(r"long step begins", timeout=120)
        texts, latencies = {}, {}
        for rank, port in ports.items():
            asked = time.monotonic()
            texts[rank] = scrape(port, timeout=1)
            latencies[rank] = time.monotonic() - asked
        inside = time.monotonic() - began
        assert inside < 4.5, f"the scrapes ended {inside:.1f} s into the 5 s step: too late to prove anything"
        assert all(latency < 1 for latency in latencies.values()), latencies
        assert finish(proc, watcher) == 0, watcher.text()[-4000:]
    finally:
        kill_group(proc)
    assert sorted(ports) == [0, 1] and len(set(ports.values())) == 2
    for rank, text in texts.items():
        promtool_check(text)
        got = values(text)
        assert got["ddp_train_steps_total"] == 5, (rank, got)  # inside step 6: steps 1 to 5 are done
        assert got["ddp_train_samples_total"] == 5 * 4
        assert got["ddp_train_tokens_total"] == 3 * got["ddp_train_samples_total"]
        assert got["ddp_train_step_seconds_count"] == 5 and got["ddp_train_data_wait_seconds_count"] == 5
        assert got["ddp_train_allreduce_seconds_count"] == 5 and got["ddp_train_allreduce_seconds_sum"] > 0
        assert got["ddp_train_global_step"] == 5 and got["ddp_train_world_size"] == 2
        assert got["ddp_train_loss"] > 0 and got["ddp_train_learning_rate"] > 0
        names = {family.name for family in text_string_to_metric_families(text)}  # the parser names Info *_info
        expected = {name + "_info" if kind == "info" else name for name, kind in FAMILIES.items()}
        assert expected <= names, expected - names
        assert 'backend="gloo"' in text and 'launcher="torchrun"' in text and f'rank="{rank}"' in text
    rank0 = values(texts[0])
    assert rank0["ddp_train_checkpoint_save_seconds_count"] == 2  # steps 2 and 4
    assert rank0["ddp_train_checkpoint_last_success_timestamp_seconds"] > 0
    assert values(texts[1])["ddp_train_checkpoint_save_seconds_count"] == 0


@pytest.mark.e2e
def test_a_busy_metrics_port_stops_the_job_before_training(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_job(tmp_path / "run", 1, "task=slow_tasks:slow_shapes", "task_options.train_size=16",
                       f"metrics.port={port}", start="alone", timeout=120, expect_ok=False)  # fmt: skip
    assert done.returncode != 0
    assert f"127.0.0.1:{port}" in done.stdout and f"metrics.port={port}" in done.stdout, done.stdout[-3000:]
    assert not re.search(r"INFO step \d+/", done.stdout), "it trained before failing on the port"
