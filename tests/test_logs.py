"""Logs a person can read (units): the step line, who logs at which level, the bar on a terminal only, the
world's numbers in the log line and each rank's own in TensorBoard and Prometheus, and the max_steps warning.

The real two-process run is ``tests/test_launch.py::test_rank0_alone_logs_the_world_mean_...``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from service.config import TrainConfig, load_config
from service.data.sampler import DataPlan
from service.loop.roles import build_roles
from service.loop.train import plan_total_steps
from service.loop.window import Window
from service.state.loop_state import LoopState
from service.telemetry.logs import configure_logging, log_level
from service.telemetry.metrics import (
    LogSink,
    NullSink,
    ProgressSink,
    StepReport,
    TensorBoardSink,
    format_step,
    progress_sink,
)
from service.telemetry.prometheus import PrometheusSink
from service.world.env import WorldInfo

REPORT = StepReport(global_step=40, total_steps=100, epoch=1, loss=0.25, lr=0.01, samples_seen=640,
                    rank_samples_per_second=100.0, world_loss=0.5, world_samples_per_second=400.0,
                    seconds_per_step=2.0)  # fmt: skip


@pytest.fixture
def service_logger(capsys):
    """What configure_logging's handler writes (pytest's stderr, read through capsys); the loggers put back."""
    logger = logging.getLogger("service")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    warnings = logging.getLogger("py.warnings")
    saved_warnings = warnings.handlers[:]
    yield lambda: capsys.readouterr().err
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
    warnings.handlers[:] = saved_warnings
    logging.captureWarnings(False)


def test_the_step_line_has_the_worlds_numbers_and_the_time_left():
    line = format_step(REPORT)
    assert line == "step 40/100 epoch 1 loss 0.5000 lr 0.01000 samples/s 400.0 eta 0:02:00"
    assert format_step(REPORT, own=True) == f"{line} | this rank: loss 0.2500 samples/s 100.0"


@pytest.mark.parametrize(("rank", "all_ranks", "level"),
                         [(0, False, logging.INFO), (1, False, logging.WARNING), (3, True, logging.INFO)])  # fmt: skip
def test_rank0_logs_info_and_the_others_only_warnings_unless_all_ranks(service_logger, rank, all_ranks, level):
    assert log_level(rank, all_ranks) == level
    configure_logging(rank, log_level(rank, all_ranks))
    LogSink(own=all_ranks).on_report(REPORT)
    logging.getLogger("service.state.resume").warning("a warning")
    text = service_logger()
    assert f"[rank {rank}] WARNING a warning" in text
    assert (f"[rank {rank}] INFO step 40/100 " in text) == (level == logging.INFO), text
    assert ("this rank: loss 0.2500" in text) == all_ranks


def test_no_bar_off_a_terminal_and_on_one_log_lines_print_above_it(service_logger):
    assert isinstance(progress_sink(10, terminal=False), NullSink)
    configure_logging(0)
    bar = progress_sink(10, terminal=True)
    assert isinstance(bar, ProgressSink)
    try:
        bar.on_step(8)
        logging.getLogger("service.loop.train").info("a line")
        handlers = logging.getLogger("service").handlers
        assert [type(handler).__name__ for handler in handlers] == ["_TqdmLoggingHandler"]
    finally:
        bar.close()
    text = service_logger()
    assert "| 1/10 [" in text  # the bar drew itself on the (pretend) terminal
    # tqdm.write: the bar's line is blanked, the log line printed whole on its own line, the bar drawn below
    assert re.search(r"\r +\r\S+ \S+ \[rank 0\] INFO a line\n\r", text), repr(text)
    assert [type(handler).__name__ for handler in logging.getLogger("service").handlers] == ["StreamHandler"]


def sinks(tmp_path: Path, rank: int, terminal: bool, *overrides: str) -> list:
    config = load_config(None, [f"run_dir={tmp_path}", "metrics.tensorboard=false", *overrides])
    world = WorldInfo("torchrun", rank=rank, local_rank=rank, world_size=2, local_world_size=2)
    roles = build_roles(config, world, total_steps=10, config_hash="hash", terminal=terminal)
    roles.close()
    return list(roles.sink.sinks)  # type: ignore[attr-defined]


def test_the_bar_is_rank0s_on_a_terminal_only_and_the_log_sink_adds_own_numbers_with_all_ranks(tmp_path):
    def kinds(rank: int, terminal: bool, *overrides: str) -> list[str]:
        return [type(sink).__name__ for sink in sinks(tmp_path, rank, terminal, *overrides)]

    assert kinds(0, True) == ["LogSink", "ProgressSink"]
    assert kinds(0, False) == ["LogSink", "NullSink"]
    assert kinds(1, True) == ["LogSink"]
    assert kinds(0, True, "train.progress_bar=false") == ["LogSink"]
    assert [sink.own for sink in sinks(tmp_path, 1, False, "logging.all_ranks=true")] == [True]
    assert [sink.own for sink in sinks(tmp_path, 1, False)] == [False]


def test_the_window_adds_the_worlds_numbers_with_one_sum_and_keeps_its_own(monkeypatch):
    """Another rank's window: loss sum 3.0 over 2 steps, 50 samples/s; ``world_sum`` adds it as the all-reduce
    would. The report keeps this rank's own loss and rate (TensorBoard, Prometheus) besides the world's. The names
    are agreed at the first report (one gather); every report after it is one collective."""
    calls, gathers = [], []
    other = {"loss": (3.0, 2.0)}

    def world_sum(values: list[float]) -> list[float]:
        calls.append(list(values))
        theirs = [0.0, 2.0, 50.0, *(number for name in window.names for number in other.get(name, (0.0, 0.0)))]
        return [mine + extra for mine, extra in zip(values, theirs, strict=True)]

    def gather(payload: bytes) -> list[bytes]:
        gathers.append(payload)
        return [payload, b'["loss"]']

    window = Window(torch.device("cpu"), world_sum, gather)
    clock = iter([100.0, 102.0, 102.0, 104.0, 104.0])  # each window's start and end: 2 s for 2 steps
    monkeypatch.setattr("service.loop.window.time.perf_counter", lambda: next(clock))
    window.reset()
    for steps_done in (2, 4):
        for value in (0.5, 1.5):
            window.log("loss", torch.tensor(value))
            window.step(16)
        calls.clear()
        report = window.report(LoopState(global_step=steps_done), 10, 0.1)
        assert (report.loss, report.rank_samples_per_second) == (1.0, 16.0)
        assert (report.world_loss, report.world_samples_per_second) == (1.25, 66.0)
        assert report.seconds_per_step == 1.0 and window.steps == 0 and report.lr == 0.1
    assert len(calls) == 1 and calls[0] == [0.0, 2, 16.0, 2.0, 2.0]  # sum, steps, rate, then each name's sum, count
    assert gathers == [b'["loss"]'] and window.names == ["loss"]


def test_a_detached_float_loss_is_logged_as_it_is_and_the_window_keeps_its_value_at_the_step():
    """Issue 38: ``s.log(loss=loss.detach())`` each step: the tensor is taken as it is (no detach, reshape and float
    copy per step: 4 µs), and the window still adds its value of that step, whatever the script does to the tensor
    afterwards; a tensor with a graph, of another dtype or shape still goes through the checks and the copy."""
    from service.loop.window import LogError, scalar

    window = Window(torch.device("cpu"), lambda values: list(values), lambda payload: [payload])
    running = torch.tensor(1.0)
    assert scalar("loss", running) is running
    for _ in range(3):
        window.log("loss", scalar("loss", running))
        running += 10.0  # a script's own running tensor, changed in place after it logged it
    assert float(window.sums["loss"]) == 1.0 + 11.0 + 21.0 and window.counts["loss"] == 3
    graph = torch.tensor(2.0, requires_grad=True) * 1.0
    assert not scalar("loss", graph).requires_grad
    assert scalar("loss", torch.tensor([3], dtype=torch.int64)).dtype == torch.float32
    with pytest.raises(LogError, match="tensor of shape"):
        scalar("loss", torch.zeros(2))


def test_prometheus_and_tensorboard_get_the_ranks_own_numbers_not_the_worlds(tmp_path):
    world = WorldInfo("torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2)
    prometheus = PrometheusSink("127.0.0.1", 0, world)
    board = TensorBoardSink(tmp_path / "tb")
    try:
        prometheus.on_report(REPORT)
        board.on_report(REPORT)
        board.writer.flush()
        labels = {"rank": "1", "local_rank": "1", "node_rank": "0", "run_id": "none"}
        assert prometheus.registry.get_sample_value("ddp_train_samples_per_second", labels) == 100.0
        assert prometheus.registry.get_sample_value("ddp_train_loss", labels) == 0.25
    finally:
        prometheus.close()
        board.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/rank_samples_per_second")] == [100.0]
    assert [e.value for e in events.Scalars("train/loss")] == [0.25]


def test_max_steps_past_what_the_epochs_allow_is_said_at_start(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("service"), "propagate", True)  # configure_logging may have cut it
    train = TrainConfig(batch_size=8, epochs=2, max_steps=500)
    plan = DataPlan(80, 0, 8, 1, 0, 1)
    with caplog.at_level(logging.WARNING, logger="service.loop.train"):
        assert plan_total_steps(plan, LoopState(), train) == 20
    (record,) = caplog.records
    assert "train.max_steps=500" in record.message and "train.epochs=2 allow only 20" in record.message
    assert "Raise train.epochs" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.loop.train"):
        assert plan_total_steps(plan, LoopState(), TrainConfig(batch_size=8, epochs=2, max_steps=20)) == 20
    assert not caplog.records
