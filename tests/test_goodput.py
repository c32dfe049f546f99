"""The goodput ledger (service/telemetry/goodput.py): the fold, the reader, rank 0's sink and its gauges, and one
real job through a SIGKILLed worker, a preemption and a rerun, scraped by a real Prometheus."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env, kill_group, read_summary, require_tool, run_job
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import worker_pids

from service.telemetry.goodput import (
    CATEGORIES,
    LEDGER,
    GoodputSink,
    Record,
    StartTimes,
    compact,
    fold,
    read_ledger,
    read_starts,
)

T0 = 1.8e9  # a Unix time


def record(pid: int = 1, start: float = T0, end: float = T0 + 10, **fields) -> Record:
    return Record(kind=fields.pop("kind", "progress"), pid=pid, process_start=start, time=end, restart_count=0,
                  world_size=2, **fields)  # fmt: skip


def total(breakdown) -> float:
    return breakdown.productive + sum(breakdown.badput.values())


# -- the fold ------------------------------------------------------------------------------------------


def test_one_start_splits_into_startup_rendezvous_restore_and_the_loop_figures():
    one = record(end=T0 + 20, group_began=T0 + 2, group_up=T0 + 3, restore_seconds=1.5, first_step=T0 + 6,
                 steps=10, step=10, productive=9.0, data_wait=2.0, checkpoint=1.0, eval=0.5)  # fmt: skip
    got = fold([one])
    assert got.wall == pytest.approx(20) and got.productive == pytest.approx(9)
    want = {"rendezvous": 1.0, "restore": 1.5, "startup": 6 - 1 - 1.5, "data_wait": 2.0, "checkpoint": 1.0,
            "eval": 0.5, "other": 20 - 6 - 9 - 2 - 1 - 0.5}  # fmt: skip
    assert {name: got.badput[name] for name in want} == pytest.approx(want)
    assert got.ratio == pytest.approx(9 / 20)


def test_a_kill_then_a_preemption_gives_recovery_lost_progress_and_preempted_idle():
    killed = record(1, T0, T0 + 10, first_step=T0 + 2, steps=8, step=8, productive=8.0)  # killed at step 8+
    resumed = record(2, T0 + 13, T0 + 20, first_step=T0 + 15, steps=5, step=10, resumed_step=5, productive=5.0,
                     status="preempted")  # fmt: skip
    rerun = record(3, T0 + 30, T0 + 35, first_step=T0 + 32, steps=3, step=13, resumed_step=10, productive=3.0,
                   status="completed")  # fmt: skip
    got = fold([rerun, killed, resumed])  # any order
    assert got.starts == 3 and got.wall == pytest.approx(35)
    assert got.badput["recovery"] == pytest.approx(3.0)  # from the killed start's last record to the next start
    assert got.badput["preempted_idle"] == pytest.approx(10.0)  # after the preempted start
    assert got.badput["lost_progress"] == pytest.approx(3.0)  # steps 6..8 again, at 1 s each
    assert got.productive == pytest.approx(8 - 3 + 5 + 3)
    assert total(got) == pytest.approx(got.wall)


def test_only_the_last_record_of_a_start_counts():
    early = record(end=T0 + 5, first_step=T0 + 1, steps=2, step=2, productive=2.0)
    late = record(end=T0 + 9, first_step=T0 + 1, steps=6, step=6, productive=6.0, kind="end")
    assert fold([late, early]).productive == pytest.approx(6.0) and fold([early, late]).wall == pytest.approx(9)


times = st.floats(0, 1e4, allow_nan=False)


@st.composite
def records(draw):
    start = T0 + draw(times)
    span = draw(times)
    steps = draw(st.integers(0, 50))
    parts = draw(st.lists(st.floats(0, 1, allow_nan=False), min_size=5, max_size=5))
    parts = [part / max(1.0, sum(parts)) * span for part in parts]  # within the span, as the validator wants
    began = start + draw(st.floats(0, 1)) * span
    return Record(kind="progress", pid=draw(st.integers(1, 4)), process_start=start, time=start + span,
                  restart_count=0, world_size=1, group_began=began, group_up=began, first_step=began if steps else None,
                  steps=steps, step=draw(st.integers(0, 100)), resumed_step=draw(st.none() | st.integers(0, 100)),
                  productive=parts[0], data_wait=parts[1], checkpoint=parts[2], eval=parts[3],
                  restore_seconds=parts[4],
                  status=draw(st.sampled_from(["running", "preempted", "failed"])))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), max_size=8))
def test_productive_plus_every_category_is_the_wall_time_for_any_records(ledger):
    """Overlapping starts, duplicates, resumes from any step: the figures are >= 0 and add up (the 1% invariant)."""
    got = fold(ledger)
    assert got.productive >= 0 and all(got.badput[name] >= 0 for name in CATEGORIES)
    assert math.isclose(total(got), got.wall, rel_tol=0.01, abs_tol=1e-6), got
    if ledger:
        first = min(r.process_start for r in ledger)
        assert got.wall <= max(r.time for r in ledger) - first + 1e-6
        assert 0 <= got.ratio <= 1 + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 100), st.floats(0, 1), st.integers(1, 20)), min_size=1, max_size=6),
       st.floats(0, 50))  # fmt: skip
def test_sequential_starts_keep_their_own_figures_and_gaps(starts, gap):
    """Starts that do not overlap: each start's productive time and each gap come back unchanged (no resume)."""
    ledger, at = [], T0
    for index, (span, share, steps) in enumerate(starts):
        ledger.append(record(index + 1, at, at + span, first_step=at, steps=steps, step=steps, productive=span * share))
        at += span + gap
    got = fold(ledger)
    assert got.productive == pytest.approx(sum(span * share for span, share, _ in starts))
    assert got.badput["recovery"] == pytest.approx(gap * (len(starts) - 1), abs=1e-6)
    assert got.wall == pytest.approx(at - gap - T0)


# -- the reader ----------------------------------------------------------------------------------------


def test_the_reader_skips_a_torn_line_garbage_and_forged_records(tmp_path, caplog):
    good = [record(end=T0 + 5), record(end=T0 + 9, first_step=T0 + 1, steps=3, step=3, productive=3.0)]
    forged = [
        dict(good[0].model_dump(), productive=1e6),  # more time than the start lasted
        dict(good[0].model_dump(), first_step=T0 - 100, steps=1),  # a first step before the process started
        dict(good[0].model_dump(), productive=-1.0),
        dict(good[0].model_dump(), status="hacked"),
        dict(good[0].model_dump(), admin=True),  # an unknown field
        dict(good[0].model_dump(), time=float("inf")),
    ]
    lines = [good[0].model_dump_json(), "not json {", "[1, 2]", "\xff\xfe", *(json.dumps(f) for f in forged),
             good[1].model_dump_json()]  # fmt: skip
    path = tmp_path / LEDGER
    torn = good[1].model_dump_json()[:40]  # a writer died in its write
    path.write_bytes(("\n".join(lines) + "\n" + torn).encode())
    assert read_ledger(path) == good
    assert "skipped 10 line(s)" in caplog.text
    assert read_ledger(tmp_path / "none.jsonl") == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(records(), st.binary(max_size=60).filter(lambda b: b"\n" not in b)), max_size=10),
       st.binary(max_size=30).filter(lambda b: b"\n" not in b))  # fmt: skip
def test_the_reader_returns_exactly_the_valid_records_among_any_bytes(tmp_path_factory, lines, torn):
    path = tmp_path_factory.mktemp("ledger") / LEDGER
    data = b"".join((line.model_dump_json().encode() if isinstance(line, Record) else line) + b"\n" for line in lines)
    path.write_bytes(data + torn)
    assert read_ledger(path) == [line for line in lines if isinstance(line, Record)]


@st.composite
def ledgers(draw):
    """A ledger's lines: a few starts, each with several records (later ones longer), in any order, among lines
    that are no records; and a torn tail."""
    lines: list[Record | bytes] = []
    for pid in range(1, draw(st.integers(1, 4)) + 1):
        start = T0 + draw(times)
        spans = sorted(draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=5)))
        for index, span in enumerate(spans):
            steps = index * 3
            lines.append(Record(kind="progress", pid=pid, process_start=start, time=start + span, restart_count=0,
                                world_size=2, first_step=start if steps else None, steps=steps, step=steps,
                                productive=span * draw(st.floats(0, 0.9)), resumed_step=draw(st.none() | st.just(0)),
                                status=draw(st.sampled_from(["running", "preempted"]))))  # fmt: skip
    lines += draw(st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b), max_size=3))
    return draw(st.permutations(lines)), draw(st.binary(max_size=30).filter(lambda b: b"\n" not in b))


@settings(max_examples=150, deadline=None)
@given(ledgers())
def test_the_streamed_and_the_compacted_ledger_fold_as_the_whole_one(tmp_path_factory, ledger):
    """Issue 24: each start reads the last record of each start, streamed, and compacts the ledger to those; the
    fold of either is the fold of every record of the whole ledger, to the bit."""
    lines, torn = ledger
    path = tmp_path_factory.mktemp("ledger") / LEDGER
    encoded = [line.model_dump_json().encode() if isinstance(line, Record) else line for line in lines]
    path.write_bytes(b"".join(line + b"\n" for line in encoded) + torn)
    whole = fold([line for line in lines if isinstance(line, Record)])
    assert fold(read_ledger(path)) == whole
    starts = read_starts(path)
    assert fold(starts) == whole and len(starts) == len({r.start_id for r in lines if isinstance(r, Record)})
    compact(path, starts)
    assert len(path.read_bytes().splitlines()) == len(starts) and set(read_ledger(path)) == set(starts)
    assert fold(read_ledger(path)) == whole and read_starts(path) == starts


def starts_ledger(path: Path, starts: int, records_each: int = 2) -> list[Record]:
    """A ledger of ``starts`` starts (pids 1, 2, ... in the order they began), ``records_each`` records each, the
    starts' records interleaved as restarts never write them but a reader must take them; the last of each."""
    lines = [record(pid, T0 + 100 * pid, T0 + 100 * pid + 10 * (k + 1)) for k in range(records_each)
             for pid in range(1, starts + 1)]  # fmt: skip
    path.write_bytes(b"".join(line.model_dump_json().encode() + b"\n" for line in lines))
    return lines[-starts:]


@pytest.mark.parametrize("over", [-1, 0, 1], ids=["one-under", "exactly-at", "one-over"])
def test_the_start_cap_keeps_at_most_its_starts_and_compaction_keeps_what_it_did_not_read(tmp_path, caplog, over):
    """Issue 39 (9, 10): MAX_STARTS, lowered to 3. One under and exactly at the cap, every start is read; one over,
    the first 3 only, with the warning. Compaction rewrites only a ledger read below the cap: a read that reached it
    may have stopped there (it does, at the first record of a start over the cap), and rewriting the file as what it
    read would drop the starts it never read."""
    cap = 3
    path = tmp_path / LEDGER
    last = starts_ledger(path, cap + over)
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING):
        starts = read_starts(path, most=cap)
    assert [r.pid for r in starts] == [1, 2, 3][: cap + over]  # the read stops at the first record over the cap
    if over <= 0:
        assert starts == last
    assert ("holds more than 3 starts" in caplog.text) == (over > 0)
    compact(path, starts, most=cap)
    if over < 0:
        assert read_ledger(path) == last  # compacted: the last record of each start, nothing else
    else:
        assert path.read_bytes() == before  # left alone: every start it holds is still there
    assert {r.start_id for r in read_ledger(path)} == {r.start_id for r in last}


@settings(max_examples=100, deadline=None)
@given(ledgers(), st.integers(1, 5))
def test_compaction_at_any_cap_never_drops_a_start_and_keeps_each_starts_last_record(tmp_path_factory, ledger, cap):
    """Issue 39 (10): for any ledger and any cap, reading then compacting keeps every start the ledger held, each
    with its newest record: the fold of the ledger is the same before and after."""
    lines, torn = ledger
    path = tmp_path_factory.mktemp("ledger") / LEDGER
    path.write_bytes(b"".join((line.model_dump_json().encode() if isinstance(line, Record) else line) + b"\n"
                              for line in lines) + torn)  # fmt: skip
    whole = read_ledger(path)
    compact(path, read_starts(path, most=cap), most=cap)
    after = read_ledger(path)
    assert {r.start_id for r in after} == {r.start_id for r in whole}
    assert fold(after) == fold(whole)


def test_a_last_line_without_its_newline_is_skipped_even_when_it_is_a_whole_record(tmp_path, caplog):
    """Issue 39 (12), decided in the ledger's docstring: a record is a line with its newline. A whole, valid record
    as the last line without one (a write that did not finish) is skipped, counted in the warning, as the next
    start's append would leave it (glued to that start's first record); with its newline it is read."""
    path = tmp_path / LEDGER
    first, second = record(1, T0, T0 + 5), record(2, T0 + 10, T0 + 20)
    path.write_bytes(first.model_dump_json().encode() + b"\n" + second.model_dump_json().encode())
    with caplog.at_level(logging.WARNING):
        assert read_ledger(path) == [first] and read_starts(path) == [first]
    assert "skipped 1 line(s)" in caplog.text
    with open(path, "ab") as file:  # the next start's first record, as GoodputSink appends it
        file.write(record(3, T0 + 30, T0 + 31).model_dump_json().encode() + b"\n")
    assert read_ledger(path) == [first]  # the same view of the earlier starts: no record came and went
    path.write_bytes(first.model_dump_json().encode() + b"\n" + second.model_dump_json().encode() + b"\n")
    assert read_ledger(path) == [first, second]


@pytest.mark.parametrize("before", ["", "whole"], ids=["only-a-torn-line", "a-record-then-a-torn-line"])
@pytest.mark.parametrize("torn", [b'{"kind": "progr', b"x" * (3 * 64 * 1024 + 5)], ids=["short", "over-max-line"])
def test_a_start_after_a_torn_last_line_keeps_its_own_records(tmp_path, caplog, before, torn):
    """Issue 39's finding: a ledger that ends in a torn line (a writer died in its write) must not swallow the next
    start's records. Rank 0 cuts the torn line off before its first append, so that start's record is a line of
    its own: read back, and still there after the start's end record. Only the torn bytes go."""
    path = tmp_path / LEDGER
    first = record(1, T0, T0 + 5)
    head = first.model_dump_json().encode() + b"\n" if before else b""
    path.write_bytes(head + torn)
    with caplog.at_level(logging.WARNING):
        sink = GoodputSink(tmp_path, 1e9, StartTimes(time.time() - 1), 1, 2)
    # cut off before the first append (a ledger with a record before it is compacted to that record first)
    assert ("ended in a torn line" in caplog.text) == (not before)
    assert path.read_bytes().startswith(head) and torn not in path.read_bytes()
    sink.finish("completed")
    sink.close()
    starts = read_starts(path)
    own = [r for r in starts if r.pid == os.getpid()]
    assert len(own) == 1 and own[0].status == "completed", starts
    assert [r for r in starts if r.pid != os.getpid()] == ([first] if before else []), starts


def ledger_of_one_start(path: Path, lines: int) -> Record:
    """``lines`` progress records of one start (one every 10 s, as the sink writes them); returns the last."""
    template = record(end=T0 + 10, first_step=T0 + 1, steps=1, step=1, productive=1.0).model_dump_json()
    head, _, tail = template.partition(f'"time":{T0 + 10}')
    with open(path, "w") as file:
        for index in range(lines):
            file.write(f'{head}"time":{T0 + 10 * (index + 1)}{tail}\n')
    return Record.model_validate_json(f'{head}"time":{T0 + 10 * lines}{tail}')


def test_reading_the_ledger_takes_memory_that_does_not_grow_with_its_lines_and_a_start_compacts_it(tmp_path):
    """Issue 24: a 35-day ledger (300,000 records) cost rank 0 about 1 GB at each start: it was read whole. Read
    streamed, the peak is the same for 5,000 and 50,000 lines of one start; and the sink compacts it once."""
    import tracemalloc

    peaks = {}
    for lines in (5_000, 50_000):
        path = tmp_path / str(lines) / LEDGER
        path.parent.mkdir()
        last = ledger_of_one_start(path, lines)
        tracemalloc.start()
        try:
            starts = read_starts(path)
            peaks[lines] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert starts == [last]
    assert peaks[50_000] < peaks[5_000] + 64 * 1024, peaks  # the old reader: about 50 MB more (linear)
    assert peaks[50_000] < 1 << 20, peaks
    sink = GoodputSink(path.parent, 1e9, StartTimes(time.time() - 1), 1, 2)
    sink.close()
    kept = read_ledger(path)
    assert kept[0] == last and [r.pid for r in kept[1:]] == [os.getpid()] * 2 and len(kept) == 3  # start, end
    assert fold(kept[:1]) == fold([last]) and sink.earlier == [last]


def test_a_start_removes_what_a_compaction_killed_before_its_rename_left(tmp_path):
    """Issue 36: a SIGKILL during the ledger's compaction lost nothing, but left its temporary file for good. The
    next start removes every such file (rank 0 alone compacts, under run_dir's lock), and nothing else."""
    path = tmp_path / LEDGER
    last = ledger_of_one_start(path, 3)
    stale = [tmp_path / f".{LEDGER}.{pid}.tmp" for pid in (4242, os.getpid())]
    for leftover in stale:
        leftover.write_bytes(b"half a record")
    others = [tmp_path / f".{LEDGER}.not-a-pid.tmp", tmp_path / "goodput-20260101T000000.jsonl"]
    for other in others:
        other.write_bytes(b"")
    sink = GoodputSink(tmp_path, 1e9, StartTimes(time.time() - 1), 1, 2)
    sink.close()
    assert not any(leftover.exists() for leftover in stale) and all(other.exists() for other in others)
    assert read_ledger(path)[0] == last


def test_a_fifo_at_the_ledger_or_the_hang_record_is_refused_with_a_warning_never_waited_on(tmp_path, caplog, capsys):
    """Issue 24: both were opened with a plain open(): a FIFO planted there blocked every start forever."""
    import threading

    from service.telemetry.hangs import FILE as HANGS
    from service.telemetry.hangs import append_hang, read_hangs, tally

    for name in (LEDGER, HANGS):
        os.mkfifo(tmp_path / name)
    done: list[object] = []

    def use_both() -> None:
        sink = GoodputSink(tmp_path, 0.0, StartTimes(time.time() - 1), 0, 2)
        sink.on_step(8, 0.01, 0.0)
        done.append(sink.finish("completed"))
        sink.close()
        append_hang(tmp_path / HANGS, {"rank": 0, "behind": [1], "step": 3})
        done.append((read_hangs(tmp_path / HANGS), tally(tmp_path / HANGS, 0).count))

    worker = threading.Thread(target=use_both, daemon=True)  # the old code blocks in open() for good: not joined
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "blocked on a FIFO"
    summary, hangs = done
    assert summary["starts"] == 1 and hangs == ([], 0)  # type: ignore[index]
    text = caplog.text
    assert f"the goodput ledger {tmp_path / LEDGER} cannot be read: {LEDGER} is a FIFO (named pipe)" in text
    assert f"the goodput ledger {tmp_path / LEDGER} could not be written ({LEDGER} is a FIFO" in text
    assert text.count("could not be written") == 1 and "remove it, and the next start writes a new ledger" in text
    assert f"the hang record {tmp_path / HANGS} is not written: {HANGS} is a FIFO" in text
    assert f"the hang record {tmp_path / HANGS} cannot be read: {HANGS} is a FIFO" in text
    assert all(stat.S_ISFIFO(os.lstat(tmp_path / name).st_mode) for name in (LEDGER, HANGS))
    from service.cli import main

    assert main(["goodput", str(tmp_path)]) == 2  # the report command says what it found there
    assert f"{tmp_path / LEDGER} is a FIFO (named pipe), not a ledger" in capsys.readouterr().err


# -- rank 0's sink -------------------------------------------------------------------------------------


def test_the_sink_appends_whole_lines_continues_an_earlier_ledger_and_serves_the_gauges(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    now = time.time()
    earlier = record(7, now - 100, now - 60, first_step=now - 90, steps=30, step=30, productive=20.0,
                     status="preempted", kind="end")  # fmt: skip
    (tmp_path / LEDGER).write_text(earlier.model_dump_json() + "\n")
    sink = GoodputSink(tmp_path, 0.01, StartTimes(now - 5, now - 4, now - 3.5, 1.0, 30), 0, 2)
    registry = CollectorRegistry()
    sink.register(registry, "job-1")
    for _ in range(5):
        sink.on_step(8, step_seconds=0.02, data_wait_seconds=0.005)
        time.sleep(0.025)  # longer than the step it reports: real time passes
    sink.on_eval(None, 0.25)  # type: ignore[arg-type]
    sink.on_checkpoint_stall(0.125)
    summary = sink.finish("completed")
    sink.close()
    lines = (tmp_path / LEDGER).read_text().splitlines()
    assert len(lines) >= 4 and all(line.startswith("{") for line in lines)
    mine = [r for r in read_ledger(tmp_path / LEDGER) if r.pid == os.getpid()]
    assert [r.kind for r in mine][0] == "start" and mine[-1].kind == "end" and mine[-1].status == "completed"
    assert (mine[-1].steps, mine[-1].step, mine[-1].resumed_step) == (5, 35, 30)
    assert mine[-1].eval == 0.25 and mine[-1].checkpoint == 0.125 and mine[-1].data_wait == pytest.approx(0.025)
    assert summary["starts"] == 2 and summary["productive_seconds"] == pytest.approx(20.075, abs=0.002)
    assert summary["badput_seconds"]["preempted_idle"] == pytest.approx(55.0, abs=0.01)
    assert summary["badput_seconds"]["restore"] == 1.0
    text = generate_latest(registry).decode()
    assert 'ddp_job_goodput_ratio{run_id="job-1",window="job"}' in text
    assert 'ddp_job_goodput_seconds{category="productive",run_id="job-1",window="5m"}' in text
    for name in CATEGORIES:
        assert f'category="{name}",run_id="job-1",window="job"' in text
    job = fold(read_ledger(tmp_path / LEDGER))
    assert job.ratio == pytest.approx(summary["ratio"], abs=0.01)
    window = sink.window()  # the last 5 minutes: the gap after the earlier start (60 s ago) and this start
    assert window.wall == pytest.approx(60, abs=0.5) and window.badput["preempted_idle"] == pytest.approx(55, abs=0.1)


def test_the_window_counts_only_the_last_five_minutes(tmp_path, monkeypatch):
    now = time.time()
    sink = GoodputSink(tmp_path, 1e9, StartTimes(now - 1000, None, None, 0.0, 0), 0, 1)
    sink.history.clear()
    sink.history.append((now - 400, sink.breakdown(now - 400)))
    sink.history.append((now - 350, sink.breakdown(now - 350)))
    window = sink.window(now)
    assert window.wall == pytest.approx(350, abs=0.01) and sink.breakdown(now).wall == pytest.approx(1000, abs=0.01)
    sink.close()


def test_a_new_job_moves_an_earlier_ledger_aside(tmp_path):
    (tmp_path / LEDGER).write_text(record().model_dump_json() + "\n")
    sink = GoodputSink(tmp_path, 10, StartTimes(time.time() - 1), 0, 1, fresh=True)
    sink.close()
    assert [r.pid for r in read_ledger(tmp_path / LEDGER)] == [os.getpid()] * 2
    assert len(list(tmp_path.glob("goodput-*.jsonl"))) == 1


def test_a_full_disk_costs_the_ledger_its_records_never_the_training(tmp_path, caplog):
    sink = GoodputSink(tmp_path, 0.0, StartTimes(time.time() - 1), 0, 1)
    os.close(sink.fd)
    sink.fd = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    sink.on_step(8, 0.01, 0.0)
    sink.first_step = time.time() + 3600  # a clock stepped back: the record is invalid, training goes on
    sink.on_step(8, 0.01, 0.0)
    assert sink.breakdown().wall > 0
    assert sink.finish("failed")["starts"] == 1
    sink.close()
    assert caplog.text.count("could not be written (No space left on device)") == 1
    assert [r.kind for r in read_ledger(tmp_path / LEDGER)] == ["start"]
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    GoodputSink(unwritable, 1.0, StartTimes(time.time()), 0, 1).close()  # run_dir is a file: no ledger, no raise


def test_the_cli_prints_the_table_and_json_and_refuses_a_missing_ledger(tmp_path, capsys):
    from service.cli import main

    (tmp_path / LEDGER).write_text(record(end=T0 + 4, first_step=T0 + 1, steps=2, step=2, productive=2.0)
                                   .model_dump_json() + "\n")  # fmt: skip
    assert main(["goodput", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "productive" in out and "50.0%" in out and "goodput 0.500 over 1 start(s)" in out
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ratio"] == 0.5
    assert main(["goodput", str(tmp_path / "nope")]) == 2
    assert "metrics.goodput=true" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_job_with_fifos_at_its_ledger_and_hang_record_trains_and_its_log_names_them(tmp_path):
    """Issue 24, end to end: 2 real processes under torchrun, metrics on (every rank reads hangs.jsonl for its hang
    count, rank 0 the ledger). The old code blocked in open() for good; run_job's timeout fails it instead."""
    from service.telemetry.hangs import FILE as HANGS

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in (LEDGER, HANGS):
        os.mkfifo(run_dir / name)
    done = run_job(run_dir, 2, "task_options.image_size=16", "task_options.train_size=64", "task_options.eval_size=16",
                   "task_options.width=4", "train.max_steps=2", "metrics.port=auto", "logging.all_ranks=true",
                   start="warm", timeout=120)  # fmt: skip
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["global_step"] == 2 and summary["goodput"]["starts"] == 1
    for rank in (0, 1):
        assert (
            f"[rank {rank}] WARNING the hang record {run_dir / HANGS} cannot be read: {HANGS} is a FIFO" in done.stdout
        )
    assert f"[rank 0] WARNING the goodput ledger {run_dir / LEDGER} cannot be read: {LEDGER} is a FIFO" in done.stdout
    assert f"the goodput ledger {run_dir / LEDGER} could not be written ({LEDGER} is a FIFO" in done.stdout
    assert all(stat.S_ISFIFO(os.lstat(run_dir / name).st_mode) for name in (LEDGER, HANGS))


# -- one real job: a SIGKILLed worker, a preemption, a rerun --------------------------------------------


def proc_start(pid: int) -> float:
    """A process's start (Unix seconds), read by the test from /proc as ps does."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_for(check, timeout: float, what: str, every: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


ITEM_SLEEP, LINGER, BATCH = 0.01, 2.0, 4


@pytest.mark.e2e
def test_a_killed_worker_a_preemption_and_a_rerun_add_up_and_prometheus_follows(tmp_path):
    from rendezvous.conftest import free_ports
    from test_prometheus_e2e import Prometheus
    from test_resume_e2e import finish, watch

    require_tool("prometheus", "`make test` installs the Debian package prometheus (apt-get, as root).")
    base = free_ports(2)
    prom = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{base}"])  # rank 0: the goodput gauges
    run_dir = tmp_path / "run"
    quick = [item for override in QUICK for item in ("--set", override)]
    job = [sys.executable, "-m", "service", "launch", "--standalone", "--nproc_per_node=2", "--max-restarts=1", *quick]
    for key, value in {"run_dir": run_dir, "task": "slow_tasks:slow_shapes", "task_options.image_size": 16,
                       "task_options.sleep": 0.02, "task_options.item_sleep": ITEM_SLEEP,
                       "task_options.linger_seconds": LINGER, "task_options.linger_rank": 1,
                       "train.batch_size": BATCH, "train.max_steps": 36,
                       "train.log_every": 1, "checkpoint.every_steps": 8, "checkpoint.snapshot_every": 0,
                       "metrics.port": base, "metrics.goodput_every_seconds": 0.25}.items():  # fmt: skip
        job += ["--set", f"{key}={value}"]
    started = time.time()
    proc, watcher = watch(job)
    try:
        watcher.wait_for(r"checkpoint saved: .*step-00000008\.pt", timeout=120)
        watcher.wait_for(r"\[rank 0\] INFO step 11/", timeout=60)
        served = {port: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                  for port in (base, base + 1)}  # fmt: skip
        assert "ddp_job_goodput_ratio{" in served[base] and "ddp_job_goodput" not in served[base + 1]  # rank 0 only
        workers = worker_pids(proc.pid)
        os.kill(workers[0], signal.SIGKILL)  # rank 0: its ledger stops at its last record, at most 0.25 s ago
        killed = time.time()
        old_exit = wait_for(lambda: gone(workers[1]) and time.time(), 40, "the first rank 1 exits")
        old = set(workers.values())  # forked workers are told apart by their start order: the old rank 1 lingers
        new = wait_for(lambda: (pid := worker_pids(proc.pid).get(0, 0)) not in (0, *old) and pid, 60, "a new rank 0")
        new_start = proc_start(new)
        watcher.wait_for(r"\[rank 0\] INFO step 20/", timeout=60)
        os.kill(proc.pid, signal.SIGTERM)
        assert finish(proc, watcher) == 75, watcher.text()[-3000:]
        first, first_text = read_summary(run_dir), watcher.text()
        assert first["status"] == "preempted" and first["restarts"] == 1 and first["goodput"]["starts"] == 2
        time.sleep(1.0)
        proc, watcher = watch(job)
        assert finish(proc, watcher) == 0, watcher.text()[-3000:]
        summary = read_summary(run_dir)
        ratio = 'max without (run_id) (ddp_job_goodput_ratio{window="job"})'  # each launch has its own run id
        ratio_series = prom.api("query_range", query=ratio, start=f"{started:.3f}", end=f"{time.time():.3f}",
                                step="0.5")["result"]  # fmt: skip
    finally:
        kill_group(proc)
        prom.stop()
    assert f"lingering {LINGER} s before exit" in first_text
    assert summary["status"] == "completed" and summary["global_step"] == 36
    out = subprocess.run([sys.executable, "-m", "service", "goodput", str(run_dir), "--json"], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    ledger, table = json.loads(out.stdout), subprocess.run(
        [sys.executable, "-m", "service", "goodput", str(run_dir)], cwd=REPO, env=child_env(), capture_output=True,
        text=True, timeout=60).stdout  # fmt: skip
    print(f"\nthe test job's breakdown:\n{table}")
    badput = ledger["badput_seconds"]
    # Categories add up to the wall time from the first start, within 1%.
    assert ledger["starts"] == 3
    assert math.isclose(ledger["productive_seconds"] + sum(badput.values()), ledger["wall_seconds"], rel_tol=0.01)
    assert badput["recovery"] > 0 and badput["lost_progress"] >= 0 and badput["preempted_idle"] > 1.0
    # The steps after step 8 that the SIGKILL cost (up to rank 0's last record) were priced as lost progress.
    starts = {r.restart_count: r for r in read_ledger(run_dir / LEDGER) if r.kind == "end"}
    assert badput["lost_progress"] > 0, starts
    # Injected delays come back: the data wait of every sample rank 0 loaded ...
    records = [r for r in read_ledger(run_dir / LEDGER)]
    last = {r.start_id: r for r in sorted(records, key=lambda r: r.time)}
    steps = sum(r.steps for r in last.values())
    want = steps * BATCH * ITEM_SLEEP
    assert abs(badput["data_wait"] - want) <= max(0.5, 0.1 * want), (badput["data_wait"], want, steps)
    # ... and rank 1's linger before its agent could restart the group, in recovery: from the SIGKILL of rank 0
    # to the new rank 0's process start, both seen by the test, with the linger in between.
    assert old_exit - killed >= LINGER, (old_exit - killed, first_text[-2000:])
    want = new_start - killed
    assert abs(badput["recovery"] - want) <= 0.5, (badput["recovery"], want, old_exit - killed)
    print(
        f"recovery {badput['recovery']:.2f} s, the test saw {want:.2f} s from the kill to the new rank 0 (rank 1 "
        f"left {old_exit - killed:.2f} s after the kill, {LINGER} s of it lingering); data_wait "
        f"{badput['data_wait']:.2f} s, injected {steps * BATCH * ITEM_SLEEP:.2f} s over {steps} steps"
    )
    # summary.json's ratio is the job's, and Prometheus saw the ratio continue across the restart.
    assert summary["goodput"]["starts"] == 3 and summary["goodput"]["ratio"] == pytest.approx(ledger["ratio"], abs=0.02)
    assert len(ratio_series) == 1, ratio_series
    values = [float(value) for _, value in ratio_series[0]["values"]]
    scraped = [stamp for stamp, _ in ratio_series[0]["values"]]
    assert values and values[-1] == pytest.approx(summary["goodput"]["ratio"], abs=0.03), values[-5:]
    positive = next(index for index, value in enumerate(values) if value > 0)
    assert min(values[positive:]) > 0, values
    assert any(b - a > 2 for a, b in zip(scraped, scraped[1:], strict=False)), "no gap between starts was scraped"


def test_a_first_start_under_launch_counts_its_start_up_from_the_agents_start():
    """``launch``'s fork server makes the imports for the first start's workers: service/worker.py puts the agent's
    start in DDP_SERVICE_STARTED_FOR, and the start-up counts from there, never from later than the process's own
    start; anything else in the variable is ignored."""
    from service.world.env import STARTED_FOR, detect_world

    own = StartTimes.of(None, None, 0.0, 0).process_start
    assert abs(own - time.time()) < 3600  # this test process's start, from /proc
    assert StartTimes.of(None, None, 0.0, 0, since=own - 4.0).process_start == own - 4.0
    later = StartTimes.of(None, None, 0.0, 0, since=own + 4.0).process_start
    assert abs(later - own) < 0.05  # never later than its own (read from /proc again: within a tick)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}  # fmt: skip
    assert detect_world({**env, STARTED_FOR: "1764669600.125"}).started_for == 1764669600.125
    for junk in ("", "soon", "-3", "0", "inf", "nan"):
        assert detect_world({**env, STARTED_FOR: junk}).started_for is None, junk
    assert detect_world(env).started_for is None
