"""The hang watchdog's pure parts and its thread's decisions, on a real store and a fake clock.

The end-to-end cases (a SIGSTOPped rank under torchrun; a SIGTERM while stuck
in a collective) are in ``tests/test_watchdog_e2e.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from service.config import ConfigError, load_config
from service.state.preemption import Preemption
from service.state.resume import config_hash
from service.telemetry.hangs import append_hang, read_hangs, tally
from service.telemetry.metrics import MetricsSink
from service.telemetry.progress import (
    AUTO_FLOOR,
    BACKWARD,
    CHECKPOINT,
    DATA,
    EVAL,
    FORWARD,
    GRACE_FLOOR,
    WINDOW,
    Progress,
    hang_timeout,
    p99,
    teardown_grace,
)
from service.telemetry.prometheus import PrometheusSink
from service.telemetry.watchdog import PREFIX, STORE_DEADLINE, Watchdog, behind_ranks, parse_record
from service.world.env import WorldInfo

seconds = st.floats(min_value=1e-6, max_value=1e5, allow_nan=False, allow_infinity=False)


@given(seconds, seconds)
def test_auto_hang_timeout_is_never_below_30_s_and_grows_with_the_p99(a, b):
    low, high = sorted((a, b))
    assert hang_timeout("auto", low, 300) >= AUTO_FLOOR
    assert hang_timeout("auto", low, 300) <= hang_timeout("auto", high, 300)
    assert hang_timeout("auto", high, 300) >= 10 * high
    assert teardown_grace(low) >= GRACE_FLOOR and teardown_grace(low) <= teardown_grace(high)


def test_hang_timeout_is_the_process_group_timeout_until_a_step_is_measured_then_the_explicit_value():
    assert hang_timeout("auto", None, 300) == 300 and hang_timeout(7.0, None, 120) == 120
    assert hang_timeout(7.0, 0.01, 300) == 7.0 and hang_timeout("auto", 0.01, 300) == AUTO_FLOOR
    assert hang_timeout("auto", 5.0, 300) == 50.0


def test_progress_keeps_the_last_steps_for_the_p99():
    progress = Progress(step=4)
    assert progress.p99() is None and progress.snapshot() == (4, "startup", 0, 0, 0, 0)
    for step in range(WINDOW + 50):
        progress.stepped(5 + step, 9.0 if step == 0 else 0.1 * (1 + step % 3))
    assert progress.step == 4 + WINDOW + 50 and progress.phase == "boundary"
    assert progress.p99() == pytest.approx(0.3)  # the 9 s step left the window
    assert p99([1.0] * 99 + [50.0]) == 1.0 and p99([1.0] * 98 + [50.0] * 2) == 50.0 and p99([2.0]) == 2.0


def test_hang_timeout_config_key_is_checked_and_mutable():
    assert load_config(None, []).dist.hang_timeout_seconds == "auto"
    assert load_config(None, ["dist.hang_timeout_seconds=12.5"]).dist.hang_timeout_seconds == 12.5
    for bad in ("2", "-1", "soon", "true"):
        with pytest.raises(ConfigError, match=r"dist.hang_timeout_seconds: must be auto .* from 3 to 604800"):
            load_config(None, [f"dist.hang_timeout_seconds={bad}"])
    # resume.MUTABLE's "dist": a changed hang timeout resumes the same run
    assert config_hash(load_config(None, ["dist.hang_timeout_seconds=9"])) == config_hash(load_config(None, []))


def test_hangs_reader_skips_a_torn_last_line_and_foreign_lines(tmp_path, caplog):
    path = tmp_path / "hangs.jsonl"
    assert read_hangs(path) == [] and tally(path, 0).count == 0 and tally(path, 0).behind_rank == -1
    append_hang(path, {"rank": 0, "behind": [1], "step": 12})
    append_hang(path, {"rank": 1, "behind": [0], "step": 13})
    with open(path, "a") as file:
        file.write('{"rank": 0, "behind": "x"}\nnot json\n')
    append_hang(path, {"rank": 0, "behind": [3, 1], "step": 20})
    with open(path, "a") as file:
        file.write('{"rank": 0, "behind": [2], "st')  # a crash mid-write
    with caplog.at_level(logging.WARNING):
        records = read_hangs(path)
    assert [(record["rank"], record["step"]) for record in records] == [(0, 12), (1, 13), (0, 20)]
    assert caplog.text.count("is not a hang record") == 2
    assert tally(path, 0).count == 2 and tally(path, 0).behind_rank == 3
    assert tally(path, 1).count == 1 and tally(path, 1).behind_rank == 0


def test_the_next_starts_prometheus_sink_exports_the_hangs_of_earlier_starts(tmp_path):
    path = tmp_path / "hangs.jsonl"
    for behind in ([1], [2]):
        append_hang(path, {"rank": 0, "behind": behind})
    world = WorldInfo("torchrun", rank=0, local_rank=0, world_size=3, local_world_size=3)
    sink = PrometheusSink("127.0.0.1", 0, world, hangs=tally(path, 0))
    try:
        labels = {"rank": "0", "local_rank": "0", "node_rank": "0", "run_id": "none"}
        value = lambda name: sink.registry.get_sample_value(name, labels)  # noqa: E731
        assert (value("ddp_train_hangs_total"), value("ddp_train_hang_behind_rank")) == (2.0, 2.0)
        sink.on_hang(1)
        assert (value("ddp_train_hangs_total"), value("ddp_train_hang_behind_rank")) == (3.0, 1.0)
    finally:
        sink.close()


def test_behind_ranks_prefers_the_silent_then_the_lowest_step_and_phase():
    def record(step, phase, heard=100.0):
        return {"step": step, "phase": phase, "tick": 0, "changed": 90.0, "heard": heard}

    fresh = {0: record(12, FORWARD), 1: record(12, DATA), 2: record(12, FORWARD)}
    assert behind_ranks(fresh, 100.5, 2.5) == [1]  # not in the collective the others wait in
    assert behind_ranks({0: record(13, DATA), 1: record(12, "boundary")}, 100.5, 2.5) == [1]
    stopped = {0: record(12, FORWARD), 1: record(12, FORWARD, heard=95.0), 2: None}
    assert behind_ranks(stopped, 100.5, 2.5) == [1, 2]  # silent, or never heard from


def test_a_rank_still_in_its_forward_is_behind_one_in_its_backward_or_in_a_collective_of_its_forward():
    """#24.8: both at step 12, one waiting in DDP's all-reduce (its backward), one looping in its own forward: the
    second alone holds the world up. Within one phase, the collectives entered tell the same (SyncBatchNorm's
    all-reduce in the forward); across micro-steps, the earlier one is behind."""

    def record(phase, micro=0, entered=0):
        return {"step": 12, "phase": phase, "tick": 0, "micro": micro, "entered": entered, "changed": 90.0,
                "heard": 100.0}  # fmt: skip

    assert behind_ranks({0: record(BACKWARD), 1: record(FORWARD)}, 100.5, 2.5) == [1]
    assert behind_ranks({0: record(FORWARD, entered=1), 1: record(FORWARD)}, 100.5, 2.5) == [1]
    assert behind_ranks({0: record(FORWARD, micro=1), 1: record(BACKWARD, micro=0)}, 100.5, 2.5) == [1]
    assert behind_ranks({0: record(FORWARD, entered=2), 1: record(FORWARD, entered=2)}, 100.5, 2.5) == [0, 1]
    old_record = {"step": 12, "phase": FORWARD, "tick": 0, "changed": 90.0, "heard": 100.0}  # no micro/entered
    assert behind_ranks({0: record(BACKWARD), 1: parse_record(json.dumps(old_record).encode())}, 100.5, 2.5) == [1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.hangs: list[int] = []

    def on_hang(self, behind_rank: int) -> None:
        self.hangs.append(behind_rank)


def make_watchdog(tmp_path: Path, store, preemption: Preemption | None = None, rank: int = 0, setting=5.0,
                  store_host: str = "the torchrun agent"):  # fmt: skip
    clock, left, sink = Clock(), [], Recorder()
    progress = Progress(step=10)
    preemption = preemption or Preemption(signals=())
    watchdog = Watchdog(progress, store, rank, 2, store_host, setting, 300, preemption, sink,
                        tmp_path / "hangs.jsonl", clock=clock, wall=clock, leave=left.append)  # fmt: skip
    return watchdog, progress, clock, left, sink


def step(progress: Progress, clock: Clock, steps: int = 3) -> None:
    for _ in range(steps):
        clock.now += 0.1
        progress.phase = DATA
        progress.tick += 1
        progress.stepped(progress.step + 1, 0.1)


def publish_peer(store, rank: int, step_done: int, phase: str, heard: float) -> None:
    record = {"step": step_done, "phase": phase, "tick": 3, "changed": heard, "heard": heard}
    store.set(str(rank), json.dumps(record))


def test_every_rank_that_fails_learns_the_first_one_and_its_own_error_from_the_store(tmp_path):
    """Issue 36: rank 1 raises; rank 0 then meets the broken connection it left. Both count themselves in the
    store, in order: the first is rank 1, with its ValueError. A store that does not answer: this rank's own."""
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    first = make_watchdog(tmp_path, store, rank=1)[0]
    then = make_watchdog(tmp_path, store, rank=0)[0]
    assert first.first_failure("ValueError: a bad batch") == (1, "ValueError: a bad batch")
    assert then.first_failure("RuntimeError: Connection closed by peer") == (1, "ValueError: a bad batch")
    assert first.first_failure("again") == (1, "ValueError: a bad batch")  # the first stays the first

    class Gone:
        def add(self, key: str, value: int) -> int:
            raise RuntimeError("connection refused")

    alone = make_watchdog(tmp_path, Gone(), rank=0)[0]
    assert alone.first_failure("RuntimeError: closed") == (0, "RuntimeError: closed")


def test_a_stall_past_the_timeout_names_the_silent_peer_dumps_stacks_and_leaves(tmp_path, capfd, caplog):
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, sink = make_watchdog(tmp_path, store)
    watchdog.check()
    assert left == [] and json.loads(store.get("0"))["step"] == 10  # published at once
    step(progress, clock)
    progress.phase = FORWARD  # waits in step 14's all-reduce
    watchdog.check()
    publish_peer(store, 1, 13, FORWARD, heard=clock.now)  # then rank 1 is stopped: silent from here
    for _ in range(49):  # 4.9 s of looks, a tenth of a second apart
        clock.now += 0.1
        watchdog.check()
    assert left == []  # 4.9 s < 5 s
    clock.now += 0.2
    with caplog.at_level(logging.ERROR):
        watchdog.check()
    assert left == [1] and sink.hangs == [1]
    assert "rank(s) 1 behind" in caplog.text and "rank 1: 13 steps done, in forward" in caplog.text
    assert "silent for 5.1 s" in caplog.text
    assert "most recent call first" in capfd.readouterr().err  # faulthandler's dump of this process's threads
    [record] = read_hangs(tmp_path / "hangs.jsonl")
    assert (record["rank"], record["behind"], record["step"], record["phase"]) == (0, [1], 13, FORWARD)


def test_a_watchdog_that_did_not_run_itself_does_not_call_its_own_stop_a_hang(tmp_path, caplog):
    """This process SIGSTOPped past the timeout (CI: the stopped rank 1, continued, blamed its peers): the gap in its
    own looks restarts its clock; a real stall after that is still found."""
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store, rank=1)
    step(progress, clock)
    watchdog.check()
    clock.now += 30  # stopped: no look for 30 s
    watchdog.check()
    assert left == [] and "did not run for a while" in caplog.text
    looks = 0
    while not left and looks < 100:  # then looks with no progress: a hang after the timeout (5 s) all the same
        clock.now += 0.1
        looks += 1
        watchdog.check()
    assert left == [1] and looks in (50, 51), looks


def test_a_peer_saving_a_checkpoint_is_progress(tmp_path, caplog):
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store, rank=1)
    step(progress, clock)
    watchdog.check()
    for _ in range(40):  # 20 s of a slow save on rank 0, its heartbeat fresh
        clock.now += 0.5
        publish_peer(store, 0, 13, CHECKPOINT, heard=clock.now)
        watchdog.check()
    assert left == [] and caplog.text.count("saving a checkpoint") == 1
    progress.phase = CHECKPOINT  # and this rank's own save is no hang either, however long (rank 0 is silent now)
    for _ in range(120):  # 60 s of looks: one jump of 60 s would read as this process being stopped, not as a stall
        clock.now += 0.5
        watchdog.check()
    assert left == []


def test_waiting_for_its_own_data_is_reported_once_and_a_hang_only_after_the_data_timeout(tmp_path, caplog):
    """#24.13: a rank in its data phase past the hang timeout (5 s) is reported, not killed, until
    dist.data_timeout_seconds (here 20 s)."""
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store, rank=1)
    watchdog.data_seconds = 20.0
    step(progress, clock)
    progress.mark(DATA)
    publish_peer(store, 0, 13, FORWARD, heard=clock.now)
    for _ in range(38):  # 19 s
        clock.now += 0.5
        publish_peer(store, 0, 13, FORWARD, heard=clock.now)
        watchdog.check()
    assert left == [] and caplog.text.count("has waited") == 1 and "for its data (in data after step 13)" in caplog.text
    clock.now += 1.5
    watchdog.check()
    assert left == [1]


def test_a_peer_waiting_for_its_data_or_compiling_is_waited_for_within_its_bound(tmp_path, caplog):
    """#24.13 and #24.12, as a peer sees them: a rank in its data phase up to dist.data_timeout_seconds, a rank
    compiling up to the start-up bound (dist.timeout_seconds, 300 s here); past those bounds, it is behind."""
    for phase, compiling, bound in ((DATA, 0, 20.0), (FORWARD, 1, 300.0)):
        store = dist.PrefixStore(PREFIX, dist.HashStore())
        watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store, rank=0)
        watchdog.data_seconds = 20.0
        step(progress, clock)
        progress.mark(FORWARD)  # waits for rank 1 in a collective
        changed = clock.now
        watchdog.check()
        while clock.now - changed < bound - 1:
            clock.now += 0.5
            record = {"step": 13, "phase": phase, "tick": 3, "compiling": compiling, "changed": changed,
                      "heard": clock.now}  # fmt: skip
            store.set("1", json.dumps(record))
            watchdog.check()
        assert left == [], phase
        assert ("waiting for their data" if phase == DATA else "rank(s) 1 compiling") in caplog.text
        clock.now += 2
        store.set("1", json.dumps({**record, "heard": clock.now}))
        watchdog.check()
        assert left == [1], phase


def test_every_graph_compiled_counts_as_compiling_whenever_dynamo_was_loaded_and_after_a_reset(tmp_path):
    """Issue 36: the callbacks were registered only if dynamo was loaded when the watchdog started, and it never is
    (DDP's constructor loads it later): no compilation counted, and an evaluation's compile under a short hang
    timeout was a hang. Now each look registers them (and after torch._dynamo.reset(), which clears them): a
    first graph, a dynamic-shape recompile and a compile after a reset each run while the record says compiling."""
    import torch._dynamo

    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, sink = make_watchdog(tmp_path, store)
    torch._dynamo.reset()  # as if loaded after the watchdog started: no callback of it registered
    seen: list[int] = []

    def backend(graph, example_inputs):
        seen.append(progress.compiling)
        return graph.forward

    try:
        watchdog.check()
        double = torch.compile(lambda x: x * 2, backend=backend)
        double(torch.ones(2))
        double(torch.ones(3))  # another shape: a recompile, with dynamic shapes
        torch._dynamo.reset()
        watchdog.check()
        double(torch.ones(4))
    finally:
        watchdog.stop()
    assert seen == [1, 1, 1] and progress.compiling == 0 and left == []


def test_compiling_is_progress_bounded_by_the_startup_bound(tmp_path):
    """#24.12: dynamo's compile callbacks mark the record; a compilation long after the steps set a 5 s timeout is no
    hang until dist.timeout_seconds (300 s here)."""
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store, rank=1)
    step(progress, clock)
    progress.mark(EVAL)
    progress.compile_started()
    for _ in range(100):  # 250 s
        clock.now += 2.5
        publish_peer(store, 0, 13, EVAL, heard=clock.now)
        watchdog.check()
    assert left == []
    progress.compile_ended()
    watchdog.check()  # the end of the compilation is progress itself
    for _ in range(49):
        clock.now += 0.1
        watchdog.check()
    assert left == []  # 4.9 s after the compilation ended: the hang timeout (5 s) is back
    clock.now += 0.2
    watchdog.check()
    assert left == [1]


def test_the_watchdogs_exit_calls_on_leave_first_and_an_error_in_it_does_not_stop_the_exit(tmp_path):
    """#24.7: os._exit skips the loop's clean-up; on_leave (the snapshots' removal on a last attempt) runs first."""
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store)
    calls: list[str] = []

    def fails() -> None:
        calls.append("on_leave")
        raise OSError("gone")

    watchdog.on_leave = fails
    step(progress, clock)
    watchdog.check()
    while not left and clock.now < 1010:  # looks a tenth of a second apart, past the 5 s timeout
        clock.now += 0.1
        watchdog.check()
    assert calls == ["on_leave"] and left == [1]


def test_a_peer_that_went_silent_while_saving_is_not_waited_for(tmp_path, caplog):
    """Rank 0 began a save and was then stopped or lost: its last record says checkpoint, but it is silent, so it is
    no save in progress; this rank's stall is a hang after the timeout, naming rank 0."""
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    watchdog, progress, clock, left, sink = make_watchdog(tmp_path, store, rank=1)
    step(progress, clock)
    progress.phase = FORWARD  # waits for rank 0 in step 14's all-reduce
    watchdog.check()
    publish_peer(store, 0, 13, CHECKPOINT, heard=clock.now)  # its last word
    looks = 0
    with caplog.at_level(logging.WARNING):
        while not left and looks < 200:  # 20 s of looks, four times the 5 s timeout
            clock.now += 0.1
            looks += 1
            watchdog.check()
    assert left == [1] and sink.hangs == [0] and looks in (50, 51), (left, looks)
    assert "saving a checkpoint" not in caplog.text
    assert "rank(s) 0 behind" in caplog.text and "rank 0: 13 steps done, in checkpoint" in caplog.text


def test_a_stop_signal_while_stuck_with_a_silent_peer_leaves_after_the_grace_and_not_while_peers_answer(tmp_path):
    for peer_alive in (True, False):
        store = dist.PrefixStore(PREFIX, dist.HashStore())
        preemption = Preemption(signals=(), clock=Clock())
        watchdog, progress, clock, left, _ = make_watchdog(tmp_path, store, preemption, setting="auto")
        preemption.clock = clock
        step(progress, clock)
        progress.phase = FORWARD
        publish_peer(store, 1, 13, FORWARD, heard=clock.now)
        watchdog.check()
        preemption.received_at = clock.now  # what the handler or the wakeup fd records
        for _ in range(12):  # 6 s: past the 2 s grace, far below the 30 s hang timeout
            clock.now += 0.5
            if peer_alive:
                publish_peer(store, 1, 13, FORWARD, heard=clock.now)
            watchdog.check()
        assert left[:1] == ([] if peer_alive else [1])


def test_the_stop_signal_is_seen_from_another_thread_through_the_wakeup_fd():
    preemption = Preemption()
    try:
        seen: list[float | None] = []
        watcher = threading.Thread(target=lambda: seen.append(wait_for(preemption.signalled_at)))
        watcher.start()
        os.kill(os.getpid(), signal.SIGUSR1)
        watcher.join()
        assert seen[0] is not None and preemption.received == "SIGUSR1"
    finally:
        preemption.close()


def wait_for(function, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := function()) is not None:
            return value
        time.sleep(0.01)
    return None


STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(60)
"""


@pytest.mark.e2e
def test_a_stopped_store_host_cannot_hang_the_watchdog_and_is_named(tmp_path, caplog):
    """Under the etcd3 rendezvous rank 0 hosts the store: SIGSTOPped, it answers nothing, yet the watchdog's
    publish and its hang report each return within the store deadline, naming rank 0."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30), wait_for_workers=False)
        store = dist.PrefixStore(PREFIX, client.clone())
        watchdog, progress, clock, left, sink = make_watchdog(tmp_path, store, rank=1, store_host="rank 0")
        step(progress, clock)
        watchdog.check()
        os.kill(host.pid, signal.SIGSTOP)
        started = time.monotonic()
        for _ in range(12):
            clock.now += 0.5
            with caplog.at_level(logging.ERROR):
                watchdog.check()
        assert time.monotonic() - started < 3 * STORE_DEADLINE + 2
        assert left[:1] == [1] and sink.hangs[:1] == [0]  # the fake leave returns: the checks go on
        assert "rank 0, which hosts the store, did not answer" in caplog.text
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
