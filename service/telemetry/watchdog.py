"""The hang watchdog: a thread per worker over its :class:`~service.telemetry.progress.Progress` record.

Once a second the thread publishes the record, with the time it last changed
and the time it was sent (the heartbeat that tells a stopped rank from a
waiting one), to the process group's store under a prefix of its own, through
a connection of its own (``store.clone()``). Every store call runs in a
helper thread and is waited for :data:`STORE_DEADLINE` seconds at most, so a
stopped store host (rank 0 under the etcd3 rendezvous, the agent under
``--standalone``) cannot hang the watchdog. It acts on two triggers:

- **A hang**: no progress on this rank for the hang timeout
  (:func:`~service.telemetry.progress.hang_timeout`), a checkpoint being saved
  anywhere excepted. Two slow things that are not hangs have bounds of their own,
  on the rank itself and as its peers see it in its record: a rank waiting for
  its own data (phase ``data``) up to ``dist.data_timeout_seconds``, reported
  once it passes the hang timeout; and a rank compiling (torch.compile) up to
  the start-up bound, ``dist.timeout_seconds``. It reads every rank's record, logs them at ERROR naming
  the rank(s) behind, dumps this process's Python stacks to stderr, appends a
  line to ``run_dir/hangs.jsonl`` (the next start's Prometheus sink exports
  it), and leaves with ``os._exit(1)``: torchrun restarts the world. A
  SIGSTOPped rank cannot run its own watchdog; the others find it silent.
- **A stuck teardown**: a stop signal (SIGTERM, SIGUSR1) came, the main thread
  has made no progress since for the grace
  (:func:`~service.telemetry.progress.teardown_grace`; not while it evaluates or
  saves), and a peer is silent or the store does not answer: the collective
  it waits in will never end. It logs one line and leaves at once instead of
  waiting out torchrun's ``--shutdown-timeout``. With every peer alive, the
  signal still stops the loop at the next step boundary, after a save.

Before either exit it calls ``on_leave``: on the last attempt (no restart will
read them) the node's in-memory snapshots are removed, since ``os._exit`` skips
the loop's own clean-up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from service.state.preemption import Preemption
from service.telemetry.hangs import append_hang
from service.telemetry.metrics import MetricsSink
from service.telemetry.progress import CHECKPOINT, DATA, EVAL, ORDER, Progress, hang_timeout, position, teardown_grace

log = logging.getLogger(__name__)

PREFIX = "watchdog/"
FAILED = "failed/"  # under PREFIX: the ranks that failed, in order (first_failure)
POLL = 0.5  # seconds between looks at the record
PUBLISH_EVERY = 1.0  # at most one store write a second
STORE_DEADLINE = 2.0  # the longest any store call of the watchdog may take
MAX_LISTED = 32  # ranks listed one by one in the hang report
FROZEN_AFTER = 3.0  # a gap this long between two looks: this process itself did not run (SIGSTOP, starved)

Record = dict[str, Any]


class StoreCaller:
    """Store calls in a helper thread, each waited for ``deadline`` seconds; none while one is stuck."""

    def __init__(self, store: Any, deadline: float = STORE_DEADLINE) -> None:
        self.store = store
        self.deadline = deadline
        self._stuck: threading.Thread | None = None

    def call(self, function: Callable[[Any], Any]) -> tuple[bool, Any]:
        """(True, the result), or (False, None) when the store failed or did not answer in time."""
        if self._stuck is not None and self._stuck.is_alive():
            return False, None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = function(self.store)
            except Exception as exc:  # a refused or closed connection: no answer either
                box["error"] = exc

        thread = threading.Thread(target=run, name="ddp-watchdog-store", daemon=True)
        thread.start()
        thread.join(self.deadline)
        if thread.is_alive():
            self._stuck = thread
            return False, None
        self._stuck = None
        return ("value" in box), box.get("value")


def parse_record(raw: bytes) -> Record | None:
    """A peer's record from the store, checked; None if it is not one."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("phase") not in ORDER:
        return None
    for key in ("micro", "entered", "compiling"):
        record.setdefault(key, 0)
    numbers = [record.get(key) for key in ("step", "tick", "changed", "heard", "micro", "entered", "compiling")]
    if any(isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
           for value in numbers):  # fmt: skip
        return None
    return record


def silent_ranks(records: Mapping[int, Record | None], now: float, silent_after: float) -> list[int]:
    """The ranks never heard from, or not for ``silent_after`` seconds."""
    return sorted(rank for rank, record in records.items() if record is None or now - record["heard"] > silent_after)


def behind_ranks(records: Mapping[int, Record | None], now: float, silent_after: float) -> list[int]:
    """The ranks holding the world up: the silent ones (:func:`silent_ranks`), else those furthest behind by
    (step, phase, micro-step, collectives entered): :func:`~service.telemetry.progress.position`."""
    silent = silent_ranks(records, now, silent_after)
    if silent:
        return sorted(silent)
    keys = {rank: position(record["step"], record["phase"], int(record.get("micro", 0)), int(record.get("entered", 0)))
            for rank, record in records.items() if record}  # fmt: skip
    if not keys:
        return []
    low = min(keys.values())
    return sorted(rank for rank, key in keys.items() if key == low)


def describe(rank: int, record: Record | None, now: float, silent_after: float) -> str:
    if record is None:
        return f"rank {rank}: never heard from"
    micro = f" (micro-step {record['micro']})" if record.get("micro") else ""
    compiling = ", compiling" if record.get("compiling") else ""
    text = (f"rank {rank}: {record['step']} steps done, in {record['phase']}{micro}{compiling}, "
            f"last progress {now - record['changed']:.1f} s ago")  # fmt: skip
    if now - record["heard"] > silent_after:
        text += f", silent for {now - record['heard']:.1f} s"
    return text


def watch_compilation(progress: Progress) -> None:
    """Count torch.compile's compilations on ``progress`` (dynamo's start and end callbacks), once dynamo is loaded
    (DDP's constructor and ``train.compile`` load it, after the watchdog starts): called at the start, at each of
    the watchdog's looks and after each model is wrapped. Idempotent; registers again what ``torch._dynamo.reset()``
    cleared. Nothing is imported here: dynamo's import takes 2 s."""
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.callback import callback_handler

    if progress.compile_started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(progress.compile_started)
    if progress.compile_ended not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(progress.compile_ended)


def unwatch_compilation(progress: Progress) -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    with contextlib.suppress(ValueError):
        dynamo.callback_handler.remove_start_callback(progress.compile_started)
    with contextlib.suppress(ValueError):
        dynamo.callback_handler.remove_end_callback(progress.compile_ended)


class Watchdog:
    """This rank's watchdog thread; :meth:`start` when training starts, :meth:`stop` when it ends.

    ``setting``: ``dist.hang_timeout_seconds``; ``startup_seconds``: ``dist.timeout_seconds``;
    ``data_seconds``: ``dist.data_timeout_seconds``; ``hangs_path``: ``run_dir/hangs.jsonl``; ``leave``:
    ``os._exit`` (a test passes its own); ``on_leave``: called just before it.
    """

    def __init__(self, progress: Progress, store: Any, rank: int, world_size: int, store_host: str,
                 setting: float | str, startup_seconds: float, preemption: Preemption, sink: MetricsSink,
                 hangs_path: Path, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, leave: Callable[[int], Any] = os._exit,
                 data_seconds: float = 600.0, on_leave: Callable[[], Any] = lambda: None) -> None:  # fmt: skip
        self.progress = progress
        self.store = StoreCaller(store)
        self.rank, self.world_size, self.store_host = rank, world_size, store_host
        self.setting, self.startup_seconds = setting, startup_seconds
        self.preemption, self.sink, self.hangs_path = preemption, sink, hangs_path
        self.clock, self.wall, self._exit, self.on_leave = clock, wall, leave, on_leave
        self.data_seconds = data_seconds
        self._last = progress.snapshot()
        self._changed, self._changed_wall = clock(), wall()
        self._looked = self._changed
        self._published = self._peers_read = -math.inf
        self._waiting_for: tuple[str, ...] = ()  # the peers' slow work this stall waits for, reported once
        self._reported_data = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls, config: Any, world: Any, dist_ctx: Any, progress: Progress, preemption: Preemption,
                sink: MetricsSink, on_leave: Callable[[], Any] = lambda: None) -> Watchdog:  # fmt: skip
        """The watchdog of one start, on a clone of the process group's store (its own connection)."""
        import torch.distributed as dist

        store = dist.PrefixStore(PREFIX, dist_ctx.store.clone())
        return cls(progress, store, world.rank, world.world_size, dist_ctx.store_host,
                   config.dist.hang_timeout_seconds, config.dist.timeout_seconds, preemption, sink,
                   Path(config.run_dir) / "hangs.jsonl", data_seconds=config.dist.data_timeout_seconds,
                   on_leave=on_leave)  # fmt: skip

    def first_failure(self, error: str, wait: float = STORE_DEADLINE) -> tuple[int, str]:
        """This rank failed with ``error``: count it in the store, in the order the ranks failed (an atomic add),
        and return the first rank that failed and its own error, not the broken connection a peer's exit left the
        others (this rank's own when it was first, or the store does not answer within ``wait`` seconds)."""
        record = json.dumps({"rank": self.rank, "error": error[:4000]})

        def count(store: Any) -> int:
            order = int(store.add(FAILED + "count", 1))
            store.set(f"{FAILED}{order}", record)
            return order

        answered, order = self.store.call(count)
        if not answered or order == 1:
            return self.rank, error
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # the first one set its record right after its count
            answered, raw = self.store.call(lambda store: store.get(FAILED + "1") if store.check([FAILED + "1"])
                                            else None)  # fmt: skip
            if not answered:
                break
            if raw is not None:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    first = json.loads(raw)
                    return int(first["rank"]), str(first["error"])
                break
            time.sleep(0.05)
        return self.rank, error

    def leave(self, code: int) -> None:
        """``on_leave`` (never stopping the exit), then the exit."""
        with contextlib.suppress(Exception):
            self.on_leave()
        self._exit(code)

    def start(self) -> None:
        watch_compilation(self.progress)
        self._thread = threading.Thread(target=self._run, name="ddp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STORE_DEADLINE + 1)
        unwatch_compilation(self.progress)

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            self.check()

    def silent_after(self, timeout: float) -> float:
        """A peer not heard from for this long is silent: stopped, gone, or cut off."""
        return max(2.5 * PUBLISH_EVERY, timeout / 2)

    def check(self) -> None:
        """One look: publish the record when due, then the two triggers."""
        watch_compilation(self.progress)  # dynamo loaded since the last look (or reset): its compilations count
        now, wall = self.clock(), self.wall()
        frozen, self._looked = now - self._looked > FROZEN_AFTER, now
        state = self.progress.snapshot()
        if frozen:  # this process was stopped or starved: its own stall is no evidence of a hang; count afresh
            log.warning("the watchdog did not run for a while (this process was stopped or starved); its hang "
                        "clock starts again")  # fmt: skip
            self._changed, self._changed_wall = now, wall
        if state != self._last:
            self._last, self._changed, self._changed_wall = state, now, wall
            self._waiting_for, self._reported_data = (), False
        if now - self._published >= PUBLISH_EVERY:
            self._published = now
            self._publish(state, wall)
        step, phase = state[0], state[1]
        step_p99 = self.progress.p99()
        timeout = hang_timeout(self.setting, step_p99, self.startup_seconds)
        signalled = self.preemption.signalled_at()
        if signalled is not None and phase not in (CHECKPOINT, EVAL):
            quiet = now - max(self._changed, signalled)
            if quiet > teardown_grace(step_p99) and now - self._peers_read >= PUBLISH_EVERY:
                self._peers_read = now
                records = self.read_records(state, wall)
                silent = silent_ranks(records, wall, self.silent_after(teardown_grace(step_p99))) \
                    if records is not None else []  # fmt: skip
                if records is None or any(rank != self.rank for rank in silent):
                    who = (f"{self.store_host}, which hosts the store, does not answer" if records is None
                           else f"rank(s) {', '.join(map(str, silent))} silent")  # fmt: skip
                    log.error("stuck after a stop signal %.1f s ago: in %s after step %d, no progress for %.1f s, "
                              "%s; leaving now instead of waiting for torchrun's SIGKILL", now - signalled,
                              phase, step, now - self._changed, who)  # fmt: skip
                    self.leave(1)
                    return
        stalled = now - self._changed
        if phase == CHECKPOINT or stalled < timeout:
            return
        own = self.own_bound(state, timeout)
        if stalled < own:  # waiting for its own data, or compiling: slow, and reported, but not a hang yet
            if phase == DATA and not self._reported_data:
                self._reported_data = True
                log.warning("rank %d has waited %.1f s for its data (in %s after step %d), past the hang timeout "
                            "of %.1f s; its loader is alive, so this is no hang until dist.data_timeout_seconds="
                            "%g", self.rank, stalled, phase, step, timeout, self.data_seconds)  # fmt: skip
            return
        self._on_stall(state, now, wall, own)

    def own_bound(self, state: tuple[int, str, int, int, int, int], timeout: float) -> float:
        """How long this rank may go without progress where it stands: the hang timeout; waiting for its own data,
        ``dist.data_timeout_seconds``; compiling, the start-up bound."""
        phase, compiling = state[1], state[5]
        bound = timeout
        if phase == DATA:
            bound = max(bound, self.data_seconds)
        if compiling:
            bound = max(bound, float(self.startup_seconds))
        return bound

    def _record(self, state: tuple[int, str, int, int, int, int], wall: float) -> Record:
        step, phase, tick, micro, entered, compiling = state
        return {"step": step, "phase": phase, "tick": tick, "micro": micro, "entered": entered,
                "compiling": compiling, "changed": self._changed_wall, "heard": wall}  # fmt: skip

    def _publish(self, state: tuple[int, str, int, int, int, int], wall: float) -> None:
        record = json.dumps(self._record(state, wall))
        self.store.call(lambda store: store.set(str(self.rank), record))

    def read_records(self, state: tuple[int, str, int, int, int, int], wall: float) -> dict[int, Record | None] | None:
        """Every rank's record (this rank's live one), None where a rank never published; None if the store
        did not answer."""

        def read(store: Any) -> dict[int, bytes | None]:
            keys = [str(rank) for rank in range(self.world_size)]
            return {int(key): store.get(key) if store.check([key]) else None for key in keys}

        answered, raw = self.store.call(read)
        if not answered:
            return None
        records = {rank: parse_record(value) if value is not None else None for rank, value in raw.items()}
        records[self.rank] = self._record(state, wall)
        return records

    def busy_peers(self, records: dict[int, Record | None], wall: float, silent_after: float) -> dict[str, list[int]]:
        """The peers, alive (heard lately), whose slow work is progress: saving a checkpoint; waiting for their own
        data, within ``dist.data_timeout_seconds``; compiling, within the start-up bound."""
        busy: dict[str, list[int]] = {"saving a checkpoint": [], "waiting for their data": [], "compiling": []}
        for rank, record in records.items():
            if rank == self.rank or not record or wall - record["heard"] > silent_after:
                continue
            quiet = wall - record["changed"]
            if record["phase"] == CHECKPOINT:
                busy["saving a checkpoint"].append(rank)
            elif record["phase"] == DATA and quiet < self.data_seconds:
                busy["waiting for their data"].append(rank)
            elif record.get("compiling") and quiet < self.startup_seconds:
                busy["compiling"].append(rank)
        return {what: ranks for what, ranks in busy.items() if ranks}

    def _on_stall(self, state: tuple[int, str, int, int, int, int], now: float, wall: float, timeout: float) -> None:
        stalled = now - self._changed
        records = self.read_records(state, wall)
        silent_after = self.silent_after(timeout)
        if records is not None:
            busy = self.busy_peers(records, wall, silent_after)
            if busy:  # a save, a peer's own data or a compilation in progress is progress: wait for it
                waiting = tuple(sorted(busy))
                if waiting != self._waiting_for:
                    self._waiting_for = waiting
                    log.warning("no progress for %.1f s, but %s: waiting for them", stalled,
                                "; ".join(f"rank(s) {', '.join(map(str, ranks))} {what}"
                                          for what, ranks in busy.items()))  # fmt: skip
                return
            behind = behind_ranks(records, wall, silent_after)
            ranks = [describe(rank, records[rank], wall, silent_after) for rank in sorted(records)[:MAX_LISTED]]
            more = len(records) - MAX_LISTED
            listing = "; ".join(ranks) + (f"; and {more} more" if more > 0 else "")
            named = f"rank(s) {', '.join(map(str, behind))} behind" if behind else "no rank behind the others"
        else:
            behind = [0] if self.store_host == "rank 0" else []
            listing = f"unknown: {self.store_host}, which hosts the store, did not answer within {STORE_DEADLINE:.0f} s"
            named = "rank 0 behind" if behind else "no rank named"
        step, phase = state[0], state[1]
        log.error("hang: no progress on this rank for %.1f s (in %s after step %d; hang timeout %.1f s, "
                  "dist.hang_timeout_seconds=%s): %s. Ranks: %s. This process's stacks follow on stderr; "
                  "exiting so that torchrun restarts the world.", stalled, phase, step, timeout, self.setting,
                  named, listing)  # fmt: skip
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(OSError):  # a full or gone run_dir must not keep a hung rank alive
            append_hang(self.hangs_path, {"time": wall, "rank": self.rank, "behind": behind, "step": step,
                                          "phase": phase, "stalled_seconds": round(stalled, 3),
                                          "timeout_seconds": timeout})  # fmt: skip
        with contextlib.suppress(Exception):
            self.sink.on_hang(behind[0] if behind else -1)
        self.leave(1)
