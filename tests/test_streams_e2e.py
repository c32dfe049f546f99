"""Issue 35 under real torchrun (2 processes): a session's streams end right.

A script written at module level (``tests/scripts/session_streams.py``: its session and loaders live until the
interpreter ends) over a Hugging Face ``datasets`` stream and over an endless torch stream, each with 2 loader
workers a rank: every run exits within seconds of its last step, completed or preempted (the loaders' workers
ignore SIGTERM, and Python's exit used to wait on them for good); the ``datasets`` stream trains every sample of its
epoch (2 workers used to read half of it); a one-shot stream of uneven shards ends its run in seconds, saying what
its uneven epoch left untrained.

One run (the endless stream cut by max_steps) starts the script as its users do, under plain torchrun, each worker
a new interpreter whose own finalization joins the loader's workers (``start="cold"``); the others go through
``ddp-service launch --script`` (``"warm"``: the same torchrun agent, its workers forked from a fork server that
imported torch once, each ending as a program does, multiprocessing's join of its loader's workers included).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env, kill_group, read_summary
from procs import worker_pids
from test_resume_e2e import LineWatcher, finish

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "scripts" / "session_streams.py"


def hf_files(directory: Path) -> Path:
    """4 files of 32 lines, one ``id`` each: 2 files a rank, 16 steps of 4 an epoch (1 file a worker at 2)."""
    directory.mkdir()
    for part in range(4):
        (directory / f"part{part}.jsonl").write_text("".join(json.dumps({"id": part * 100 + line}) + "\n"
                                                             for line in range(32)))  # fmt: skip
    return directory


def script(kind: str, run: Path, sets: tuple[str, ...], *args: str, start: str = "cold",
          **env: str) -> tuple[subprocess.Popen, LineWatcher]:  # fmt: skip
    """The script at 2 processes, ``start`` ``"cold"`` (plain torchrun) or ``"warm"`` (``ddp-service launch
    --script``, its workers forked from the fork server: conftest.STARTS)."""
    (run / "out").mkdir(parents=True, exist_ok=True)
    own = [kind, str(run / "out"), *args]  # the script's own arguments
    if start == "warm":  # launch's options (its --set items reach the script), then the script and its arguments
        cmd = [sys.executable, "-m", "service", "launch", "--nproc-per-node=2", "--max-restarts=0"]
        tail = ["--script", str(SCRIPT), "--", *own]
    else:  # torchrun's options, then the script, its arguments and the --set items it reads itself
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=0",
               str(SCRIPT), *own]  # fmt: skip
        tail = []
    for override in (*QUICK, f"run_dir={run / 'run'}", "train.log_every=1", "logging.all_ranks=true", *sets):
        cmd += ["--set", override]
    cmd += tail
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(PYTHONUNBUFFERED="1", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    return proc, LineWatcher(proc)


def traced(run: Path) -> dict[int, list[dict]]:
    return {rank: [json.loads(line) for line in (run / "out" / f"rank{rank}.jsonl").read_text().splitlines()]
            for rank in (0, 1)}  # fmt: skip


def ended(proc: subprocess.Popen, watcher: LineWatcher, run: Path, timeout: float = 150) -> tuple[int, float]:
    """(the exit code, seconds from the last step either rank traced to torchrun's exit)."""
    try:
        code = finish(proc, watcher, timeout=timeout)
    finally:
        kill_group(proc)
    exited = time.time()
    last = max(line["at"] for lines in traced(run).values() for line in lines)
    return code, exited - last


def preempted(kind: str, run: Path, sets: tuple[str, ...], *args: str, start: str = "cold") -> tuple[int, float]:
    """SIGTERM to rank 1's worker once rank 0 logged step 3 (steps slowed to 0.3 s), then to the end."""
    proc, watcher = script(kind, run, sets, *args, start=start, STEP_SLEEP="0.3")
    try:
        watcher.wait_for(r"\[rank 0\] INFO step 3/", timeout=180)
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)  # not a loader worker: the first started of local rank 1
    except BaseException:
        kill_group(proc)
        raise
    return ended(proc, watcher, run)


def test_streams_with_loader_workers_exit_in_seconds_and_a_datasets_stream_trains_its_whole_epoch(tmp_path):
    """2 processes x 2 loader workers: a ``datasets`` stream's epoch (128 samples, 16 steps), completed, trains each
    sample once; an endless stream stopped by max_steps, completed; each of them preempted: every run exits within
    30 s of its last step, its summary written.

    The endless stream cut by max_steps runs as its users start it (plain torchrun: each worker an interpreter that
    ends in Python's own finalization, where multiprocessing joins the loader's workers); the three others under
    ``ddp-service launch --script`` (forked workers that end as a program does), which holds the same join."""
    data = hf_files(tmp_path / "data")
    workers = ("data.num_workers=2",)
    for kind, sets, args, (completed, stopped) in (
        ("hf", ("train.epochs=1", "train.max_steps=1000"), (str(data),), ("warm", "warm")),
        ("endless", ("train.max_steps=12",), (), ("cold", "warm")),
    ):
        run = tmp_path / f"{kind}-completed"
        proc, watcher = script(kind, run, (*workers, *sets), *args, start=completed)
        code, after = ended(proc, watcher, run)
        assert code == 0, watcher.text()[-4000:]
        assert after < 30, (after, watcher.text()[-3000:])
        summary = read_summary(run / "run")
        assert summary["status"] == "completed", summary
        if kind == "hf":  # the whole epoch, each sample once, as num_workers=0 reads it
            ids = [i for lines in traced(run).values() for line in lines for i in line["ids"]]
            assert sorted(ids) == sorted(part * 100 + line for part in range(4) for line in range(32)), ids
            assert summary["global_step"] == 16 and summary["epochs_completed"] == 1, summary
            assert summary["dropped_batches"] == 0
        else:
            assert summary["global_step"] == 12

        run = tmp_path / f"{kind}-preempted"
        code, after = preempted(kind, run, (*workers, *sets), *args, start=stopped)
        summary = read_summary(run / "run")
        assert code != 0 and after < 30, (code, after, summary)
        assert summary["status"] == "preempted" and summary["stopped_at_step"] >= 3, summary


def test_a_streams_state_that_could_not_be_loaded_back_is_refused_before_any_save(tmp_path):
    """A stream whose state_dict holds an object of its own (not a plain value): every rank refuses it at the end
    of the first step, before the first save, naming the stream, where the value sits and its type; no checkpoint
    is written (one used to be written, that every resume then refused). The failed run, 2 loader workers a rank,
    exits within 30 s of its step."""
    run = tmp_path / "unloadable"
    proc, watcher = script("unloadable", run, ("train.max_steps=6", "checkpoint.every_steps=1", "data.num_workers=2"),
                           start="warm")  # fmt: skip
    code, after = ended(proc, watcher, run, timeout=120)
    output = watcher.text()
    assert code != 0 and after < 30, (code, after, output[-4000:])
    refusal = (r"ERROR s\.batches\(a __main__\.Unloadable\): the stream's state_dict\(\) .*: its "
               r"state_dict\(\)\[.*\['stream'\]\['position'\] is a __main__\.Position, which a resume "
               "could not load back")  # fmt: skip
    assert len(re.findall(refusal, output)) >= 2, output[-4000:]  # each rank's, as bad input: no traceback of it
    assert "KeepError" not in output and not (run / "run" / "summary.json").exists()  # a refusal writes nothing
    assert not list((run / "run" / "checkpoints").glob("step-*")), sorted((run / "run" / "checkpoints").iterdir())


def test_a_one_shot_stream_of_uneven_shards_ends_its_run_in_seconds_naming_what_it_left(tmp_path):
    """Each rank's own generator, read once (shard=False), rank 0 with 16 batches and rank 1 with 4: epoch 0 ends
    at step 4 for both, saying once that rank 0 had 12 batches left (summary.json counts them); epoch 1 finds the
    stream used up, and the run ends there (completed, with why and the fix), in seconds, where it used to spin
    on empty epochs for 10 minutes. A rerun trains nothing more. (The session's own logic, not a process's end: both
    runs under ``ddp-service launch --script``.)"""
    run = tmp_path / "oneshot"
    sets = ("train.epochs=3", "train.max_steps=1000")
    started = time.monotonic()
    proc, watcher = script("oneshot", run, sets, start="warm")
    code, _ = ended(proc, watcher, run, timeout=120)
    output = watcher.text()
    assert code == 0 and time.monotonic() - started < 60, output[-4000:]
    summary = read_summary(run / "run")
    assert summary["status"] == "completed" and summary["global_step"] == 4, summary
    assert summary["dropped_batches"] == 12 and summary["epochs_completed"] == 1, summary
    assert output.count("[rank 0] WARNING epoch 0 of the stream") == 1, output[-4000:]
    assert output.count("were left untrained") == 2  # once on each rank (logging.all_ranks)
    assert "12 batches of 4 samples were left untrained (rank 0: 12, rank 1: 0)" in output
    assert "gave no batch in epoch 1" in output and "Make the stream's __iter__ start it afresh" in output
    assert [len(lines) for lines in traced(run).values()] == [4, 4]

    proc, watcher = script("oneshot", run, sets, start="warm")
    code, _ = ended(proc, watcher, run, timeout=120)
    assert code == 0 and read_summary(run / "run")["global_step"] == 4, watcher.text()[-3000:]
    assert [len(lines) for lines in traced(run).values()] == [4, 4]
