"""The goodput ledger: where a job's wall-clock time went, across every restart.

Rank 0 alone holds a :class:`GoodputSink` (every other rank a :class:`NoGoodput`). It adds up, from the
events the loop already sends every sink, this start's productive step time, data wait, checkpoint stall
and evaluation, and appends one JSON line (a :class:`Record`: this start's totals so far) to
``run_dir/goodput.jsonl`` at start, every ``metrics.goodput_every_seconds`` and at the end: one
``os.write`` of one line on an ``O_APPEND`` descriptor, so a crash leaves at most a torn last line, which
the reader skips with every line that does not parse or validate. At start it reads the last record of each
earlier start, streamed, and compacts the ledger to those (:mod:`service.telemetry.ledger`).

:func:`fold` turns the ledger into the job's breakdown (``docs/monitoring.md``, Goodput): the last record
of each start gives that start's categories, the gaps between starts are ``recovery`` (or
``preempted_idle`` after a preempted start), the steps recomputed after a resume are ``lost_progress``,
and ``other`` is what is left, so productive plus every category is the wall time from the first start.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from service.state.files import open_append
from service.telemetry.ledger import (  # noqa: F401 (LEDGER, Record, read_ledger: the ledger's names, here too)
    LEDGER,
    Record,
    Status,
    compact,
    cut_torn_tail,
    last_per_start,
    read_ledger,
    read_starts,
)
from service.telemetry.metrics import EvalReport, MetricsSink

log = logging.getLogger(__name__)

CATEGORIES = ("startup", "rendezvous", "restore", "checkpoint", "data_wait", "eval", "lost_progress", "recovery",
              "preempted_idle", "other")  # fmt: skip
WINDOW_SECONDS = 300.0  # the window="5m" series


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """The job's wall time from its first start, split into productive time and each badput category."""

    wall: float = 0.0
    productive: float = 0.0
    badput: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    starts: int = 0

    @property
    def ratio(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def minus(self, earlier: Breakdown) -> Breakdown:
        """What happened between ``earlier`` and this (a window), each figure at least 0."""
        badput = {name: max(0.0, self.badput[name] - earlier.badput[name]) for name in CATEGORIES}
        return Breakdown(max(0.0, self.wall - earlier.wall), max(0.0, self.productive - earlier.productive), badput,
                         self.starts - earlier.starts)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"ratio": round(self.ratio, 6), "wall_seconds": round(self.wall, 3),
                "productive_seconds": round(self.productive, 3), "starts": self.starts,
                "badput_seconds": {name: round(self.badput[name], 3) for name in CATEGORIES}}  # fmt: skip


def fold(records: Iterable[Record]) -> Breakdown:
    """The job's breakdown from its ledger's records (any order, any start's any records).

    Starts are laid on one time line from the first one's process start; a start that overlaps the one before
    (clocks of two hosts, a forged record) counts from where that one ended, and each category of a start is
    capped by what its span has left, in the order below, so the figures never add up to more than the wall
    time: productive + every category == wall, always.
    """
    starts = last_per_start(records)
    if not starts:
        return Breakdown()
    badput = dict.fromkeys(CATEGORIES, 0.0)
    productive: list[float] = []
    origin = cursor = starts[0].process_start
    previous: Record | None = None
    for record in starts:
        begin = max(record.process_start, cursor)
        if previous is not None:
            badput["preempted_idle" if previous.status == "preempted" else "recovery"] += begin - cursor
        end = max(record.time, begin)
        left = end - begin
        rendezvous = (record.group_up - record.group_began) if record.group_up and record.group_began else 0.0
        until_first = (record.first_step or record.time) - record.process_start
        startup = until_first - rendezvous - record.restore_seconds
        wanted = (("rendezvous", rendezvous), ("restore", record.restore_seconds), ("startup", startup),
                  ("data_wait", record.data_wait), ("productive", record.productive),
                  ("checkpoint", record.checkpoint), ("eval", record.eval))  # fmt: skip
        own = 0.0
        for name, seconds in wanted:
            taken = min(max(0.0, seconds), left)
            left -= taken
            if name == "productive":
                own = taken
            else:
                badput[name] += taken
        badput["other"] += left
        if previous is not None and record.resumed_step is not None and previous.steps:
            recomputed = max(0, previous.step - record.resumed_step)
            lost = min(recomputed * previous.productive / previous.steps, productive[-1])
            productive[-1] -= lost
            badput["lost_progress"] += lost
        productive.append(own)
        cursor, previous = end, record
    wall = cursor - origin
    total = sum(productive)
    return Breakdown(wall, total, badput, len(starts))


def process_start_time(pid: int | str = "self") -> float | None:
    """This process's (or ``pid``'s) start (Unix seconds) from /proc: its starttime after boot, against
    /proc/uptime, both on the boot clock (10 ms ticks); None where there is no /proc (the caller falls back)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + int(fields[19]) / ticks  # field 22 of stat: the 20th after the name


@dataclasses.dataclass(frozen=True)
class StartTimes:
    """What this start knows of its own start-up before the loop: Unix times, and the resume's duration."""

    process_start: float
    group_began: float | None = None
    group_up: float | None = None
    restore_seconds: float = 0.0
    resumed_step: int | None = None

    @classmethod
    def of(cls, group_began: float | None, group_up: float | None, restore_seconds: float, resumed_step: int,
           since: float | None = None) -> StartTimes:  # fmt: skip
        """This start's times; without /proc, the process start falls back to when its process group set-up
        began (so start-up then counts from there; earlier time falls into the gap before, i.e. recovery).
        ``since``: an earlier start of the work done for this process (a first start under ``launch``: its fork
        server's start, whose imports a worker started as a program pays itself)."""
        began = process_start_time() or group_began or time.time()
        if since is not None and since < began:
            began = since
        return cls(began, group_began, group_up, restore_seconds, resumed_step)


class NoGoodput(MetricsSink):
    """Every rank but 0: no ledger, no breakdown in the summary."""

    def finish(self, status: str) -> dict[str, Any] | None:
        return None

    def register(self, registry: Any, run_id: str) -> None:
        """Serve the job's goodput gauges from ``registry`` (rank 0's Prometheus one)."""

    def restored(self, seconds: float) -> None:
        """The resume's whole time (its agreement and every kept object's load), known once training starts."""


class GoodputSink(NoGoodput):
    """Rank 0's ledger: adds up this start's time from the loop's events and appends it every ``every`` s."""

    def __init__(self, run_dir: Path, every: float, times: StartTimes, restart_count: int, world_size: int,
                 rendezvous_round: int | None = None, fresh: bool = False) -> None:  # fmt: skip
        self.path = Path(run_dir) / LEDGER
        self.failed = False  # the ledger never stops training: a failed write is logged once and skipped
        self.fd: int | None = None
        self.earlier: list[Record] = []  # the job's earlier starts, their last records: the gauges continue
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if fresh and self.path.exists():  # checkpoint.resume=never: a new job; an earlier ledger moves aside
                os.replace(self.path, self.path.with_name(f"goodput-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"))
            self.earlier = read_starts(self.path)  # streamed: memory grows with the starts, not the lines
            compact(self.path, self.earlier)  # ... and the next start reads those lines alone
            self.fd = open_append(self.path.parent, LEDGER)  # a regular file only: a FIFO is refused, not waited on
            cut_torn_tail(self.path, self.fd)  # this start's first record begins a line, glued to no torn one
        except (OSError, ValueError) as exc:
            self._failed(exc)
        self.every = every
        self.lock = threading.Lock()  # the scrape thread folds while the loop adds
        self.status: Status = "running"
        self.closed = False
        self.totals = {"productive": 0.0, "data_wait": 0.0, "checkpoint": 0.0, "eval": 0.0}
        self.steps = self.step = 0
        self.first_step: float | None = None
        self.fixed = {"pid": os.getpid(), "process_start": times.process_start, "restart_count": restart_count,
                      "world_size": world_size, "rendezvous_round": rendezvous_round,
                      "group_began": times.group_began, "group_up": times.group_up,
                      "restore_seconds": times.restore_seconds, "resumed_step": times.resumed_step}  # fmt: skip
        self.step = times.resumed_step or 0
        self.history: collections.deque[tuple[float, Breakdown]] = collections.deque()
        if self.earlier:  # the window reaches back over the gap before this start
            before = fold(self.earlier)
            self.history.append((self.earlier[0].process_start + before.wall, before))
        self.due = 0.0
        self._append("start")

    def record(self, kind: Literal["start", "progress", "end"], now: float | None = None) -> Record:
        """This start's record at ``now``, unchecked: a clock stepped back must not stop training (a reader
        skips such a record; the fold caps every figure anyway)."""
        now = time.time() if now is None else now
        values: dict[str, Any] = {"kind": kind, "time": now, "first_step": self.first_step, "step": self.step,
                                  "steps": self.steps, "status": self.status, **self.fixed, **self.totals}  # fmt: skip
        return Record.model_construct(None, **values)

    def breakdown(self, now: float | None = None) -> Breakdown:
        with self.lock:
            return fold([*self.earlier, self.record("progress", now)])

    def _append(self, kind: Literal["start", "progress", "end"]) -> None:
        now = time.time()
        with self.lock:
            record = self.record(kind, now)
            breakdown = fold([*self.earlier, record])
        if self.fd is not None:
            try:
                os.write(self.fd, (record.model_dump_json() + "\n").encode())
            except OSError as exc:
                self._failed(exc)
        self.history.append((now, breakdown))
        while len(self.history) > 2 and self.history[1][0] <= now - WINDOW_SECONDS:
            self.history.popleft()
        self.due = time.monotonic() + self.every

    def _failed(self, exc: OSError | ValueError) -> None:
        if not self.failed:
            self.failed = True
            why, fix = ((exc.strerror or exc, "free space in run_dir or make it writable") if isinstance(exc, OSError)
                        else (exc, "remove it, and the next start writes a new ledger"))  # fmt: skip
            log.warning("the goodput ledger %s could not be written (%s): its figures miss what this start does "
                        "from here; %s (training goes on)", self.path, why, fix)  # fmt: skip

    def window(self, now: float | None = None) -> Breakdown:
        """The last five minutes (or since this start, if shorter), from the records kept in memory."""
        now = time.time() if now is None else now
        current = self.breakdown(now)
        older = [breakdown for stamp, breakdown in list(self.history) if stamp <= now - WINDOW_SECONDS]
        base = older[-1] if older else (self.history[0][1] if self.history else Breakdown())
        return current.minus(base)

    def on_step(self, rank_samples: int, step_seconds: float = 0.0, data_wait_seconds: float = 0.0,
                tokens: int = 0) -> None:  # fmt: skip
        with self.lock:
            if self.first_step is None:
                self.first_step = time.time() - step_seconds
            self.steps += 1
            self.step += 1
            self.totals["productive"] += max(0.0, step_seconds - data_wait_seconds)
            self.totals["data_wait"] += data_wait_seconds
        if time.monotonic() >= self.due:
            self._append("progress")

    def on_checkpoint_stall(self, seconds: float) -> None:
        self.totals["checkpoint"] += seconds

    def on_eval(self, report: EvalReport, seconds: float = 0.0) -> None:
        self.totals["eval"] += seconds

    def finish(self, status: str) -> dict[str, Any]:
        """The job's breakdown for ``summary.json``, after this start's end record (status: how it ended)."""
        self.status = status if status in ("completed", "preempted", "failed", "lock_lost") else "failed"  # type: ignore[assignment]
        self._append("end")
        return self.breakdown().as_dict()

    def register(self, registry: Any, run_id: str) -> None:
        registry.register(GoodputCollector(self, run_id))

    def restored(self, seconds: float) -> None:
        with self.lock:
            self.fixed["restore_seconds"] = max(0.0, seconds)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.status == "running":
            self.status = "failed"
        self._append("end")
        if self.fd is not None:
            os.close(self.fd)


class GoodputCollector:
    """``ddp_job_goodput_seconds{category, window}`` and ``ddp_job_goodput_ratio{window}`` from rank 0's
    ledger at each scrape: ``window="job"`` since the job's first start, ``window="5m"`` the last five minutes."""

    def __init__(self, sink: GoodputSink, run_id: str) -> None:
        self.sink = sink
        self.run_id = run_id

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        seconds = GaugeMetricFamily("ddp_job_goodput_seconds", "The job's wall time by category: productive step "
                                    "time and each badput category (docs/monitoring.md, Goodput).",
                                    labels=["run_id", "window", "category"])  # fmt: skip
        ratio = GaugeMetricFamily("ddp_job_goodput_ratio", "Productive step time over the wall time.",
                                  labels=["run_id", "window"])  # fmt: skip
        now = time.time()
        for window, breakdown in (("job", self.sink.breakdown(now)), ("5m", self.sink.window(now))):
            seconds.add_metric([self.run_id, window, "productive"], breakdown.productive)
            for name in CATEGORIES:
                seconds.add_metric([self.run_id, window, name], breakdown.badput[name])
            ratio.add_metric([self.run_id, window], breakdown.ratio if math.isfinite(breakdown.ratio) else 0.0)
        yield seconds
        yield ratio
