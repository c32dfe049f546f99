"""One job per run_dir (issue 10, point 4), no orphans (point 5), train.nonfinite (point 6); real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env, kill_group, read_summary, run_job
from procs import worker_pids
from rendezvous.conftest import free_ports
from test_resume_e2e import SLOW, finish, start, watch

from service.world.runlock import LOCK_NAME, RunDirLock, RunDirLockedError

pytestmark = pytest.mark.e2e


def environ_of(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in items if b"=" in item)


def gone(pid: int) -> bool:
    """Not running: no such pid, or a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if all(gone(pid) for pid in pids):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"still running {timeout} s later: {[pid for pid in pids if not gone(pid)]}")


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# ------------------------------------------------------------------------------------------- one job per run_dir


def test_a_second_job_on_the_same_run_dir_fails_fast_naming_the_first(tmp_path):
    run_dir, slow = tmp_path / "run", tmp_path / "slow"
    slow.touch()  # the first job's steps sleep until the second one was refused, then go at full speed
    # 100 steps of 0.3 s: 30 s for the refusal (a sleep costs no CPU), and few steps left at full speed after it.
    job = (*SLOW, "train.max_steps=100", "train.epochs=10", "task_options.sleep=0.3",
           f"task_options.sleep_while={slow}")  # fmt: skip
    first, watcher = start(run_dir, 1, *job)  # torchrun's: its worker's environment names the run id
    try:
        watcher.wait_for(r"\[rank 0\] INFO step 2/", timeout=120)
        holder = worker_pids(first.pid)[0]
        run_id = environ_of(holder)["TORCHELASTIC_RUN_ID"]
        started = time.monotonic()
        second = run_job(run_dir, 1, *job, expect_ok=False, timeout=90, start="alone")  # the lock is the trainer's
        took = time.monotonic() - started
        assert second.returncode != 0
        for needle in ("RunDirLockedError", f"pid {holder} on host {socket.gethostname()!r}", f"run id {run_id!r}",
                       "since ", "Use another run_dir"):  # fmt: skip
            assert needle in second.stdout, f"{needle!r} missing:\n{second.stdout[-3000:]}"
        assert " INFO step " not in second.stdout and took < 60
        assert first.poll() is None  # the refusal came while the first job was still training
        slow.unlink()
        assert finish(first, watcher) == 0, watcher.text()[-3000:]
    finally:
        kill_group(first)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["global_step"] == 100  # the first job's, untouched
    assert not (run_dir / LOCK_NAME).exists()  # released on exit


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid = dead_pid()
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "run_id": "old-job",
                                                 "started": time.time() - 60, "token": "x"}))  # fmt: skip
    done = run_job(run_dir, 1, *SLOW, "train.max_steps=2", "task_options.sleep=0", start="alone")
    assert f"pid {pid} on host {socket.gethostname()!r}, run id 'old-job'" in done.stdout
    assert f"is stale (its process {pid} on this host is gone): taking it over" in done.stdout
    assert read_summary(run_dir)["status"] == "completed" and not (run_dir / LOCK_NAME).exists()


def test_locks_of_other_hosts_go_stale_only_without_heartbeat(tmp_path):
    """The rule for hosts whose pids cannot be checked: the mtime (renewed every `renew` s) decides."""
    lock_path = tmp_path / LOCK_NAME
    lock_path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "run_id": "other", "started": 0, "token": "t"}))
    with pytest.raises(RunDirLockedError, match=r"pid 1 on host 'elsewhere', run id 'other'"):
        RunDirLock(tmp_path, "mine", renew=1.0, stale_after=3).acquire()
    os.utime(lock_path, (time.time() - 10, time.time() - 10))
    taker = RunDirLock(tmp_path, "mine", renew=0.2, stale_after=3)
    taker.acquire()
    assert json.loads(lock_path.read_text())["run_id"] == "mine"
    renewed = lock_path.stat().st_mtime
    time.sleep(0.5)
    assert lock_path.stat().st_mtime > renewed  # the heartbeat renews it
    with pytest.raises(RunDirLockedError):  # a live holder on this host is refused
        RunDirLock(tmp_path, "mine").acquire()
    taker.release()
    assert not lock_path.exists()


def test_a_restart_of_the_same_job_after_its_rank0_was_killed_takes_the_lock_over(tmp_path):
    """SIGKILL of the lock holder (rank 0) under --max-restarts=1: the next attempt's rank 0 takes the lock over."""
    run_dir = tmp_path / "run"
    job = (*SLOW, "train.max_steps=16", "train.epochs=10", "checkpoint.every_steps=4", "task_options.sleep=0.04")
    proc, watcher = start(run_dir, 2, *job, launcher=("--standalone", "--max-restarts=1"), start="warm")
    try:
        watcher.wait_for(r"checkpoint saved: .*step-00000004\.pt", timeout=120)
        os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        assert finish(proc, watcher) == 0, watcher.text()[-4000:]
    finally:
        kill_group(proc)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["restarts"] == 1, watcher.text()[-3000:]
    assert "is stale (its process" in watcher.text() and "taking it over" in watcher.text()


SAVED = re.compile(r"\[rank 0\] INFO checkpoint saved: .*step-(\d+)\.pt")
STOPPED = re.compile(r"\[rank (\d)\] ERROR stopped at step (\d+) without a checkpoint: (.*)")


@pytest.mark.parametrize("how", ["deleted", "taken"])
def test_a_job_whose_lock_is_deleted_or_taken_stops_every_rank_at_one_step_and_writes_nothing_more(tmp_path, how):
    """Issue 15, point 7: `rm run/.lock` (or another job's lock in its place) during training stops the job."""
    run_dir = tmp_path / "run"
    job = (*SLOW, "train.max_steps=400", "train.epochs=100", "checkpoint.every_steps=1", "task_options.sleep=0.05")
    proc, watcher = start(run_dir, 2, *job, start="warm")
    lock, other = run_dir / LOCK_NAME, {"host": "node9", "pid": 4242, "run_id": "other-job", "started": time.time()}
    try:
        watcher.wait_for(r"checkpoint saved: .*step-00000003\.pt", timeout=120)
        if how == "deleted":
            lock.unlink()
        else:  # another job took it over, as a taker does: its lock renamed into place
            (run_dir / "other.lock").write_text(json.dumps({**other, "token": "o"}))
            os.replace(run_dir / "other.lock", lock)
        lost_at = watcher.wait_for(rf"ERROR The run_dir lock {re.escape(str(lock))} was", timeout=30)
        theirs = {
            run_dir / "summary.json": '{"status": "running", "job": "other-job"}\n',
            run_dir / "checkpoints" / ".step-00000100.4242.tmp": "the other job's save in progress",
        }
        if how == "taken":  # the other job's files, written once it holds the lock
            for path, text in theirs.items():
                path.write_text(text)
        code = finish(proc, watcher, timeout=60)
    finally:
        kill_group(proc)
    out = watcher.text()
    assert code == 1, out[-4000:]  # failed: not 0, and not 75 (which would say "resume me")
    expected = "was deleted" if how == "deleted" else "was taken by pid 4242 on host 'node9', run id 'other-job', since"
    assert f"The run_dir lock {lock} {expected}" in out and "while this job held it" in out
    stops = {int(rank): (int(step), why) for rank, step, why in STOPPED.findall(out)}
    assert set(stops) == {0, 1}, out[-4000:]
    assert stops[0][0] == stops[1][0], stops  # every rank stopped at the same step boundary
    assert expected in stops[0][1] and "lost the run_dir lock" in stops[1][1]
    step = stops[0][0]
    late_saves = [line for stamp, line in watcher.lines if stamp > lost_at and SAVED.search(line)]
    assert late_saves == [], late_saves  # the writers are fenced before the loss is logged: nothing saved after it
    on_disk = sorted(int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert on_disk and on_disk[-1] <= step and " INFO step " in out
    if how == "deleted":  # nobody holds run_dir: the summary says why this job stopped, and the lock stays gone
        summary = read_summary(run_dir)
        assert summary["status"] == "lock_lost" and summary["stopped_at_step"] == step
        assert "was deleted while this job held it" in summary["error"]
        assert not os.path.lexists(lock)
    else:  # the other job's lock, summary and temporary file are as it left them
        assert json.loads(lock.read_text())["run_id"] == "other-job"
        assert {path: path.read_text() for path in theirs} == theirs
        assert "summary not written" in out


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (the SigCgt mask in /proc/PID/status); False once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_twenty_preemptions_in_a_row_each_end_75_and_leave_no_stale_lock(tmp_path):
    """#24.9: SIGTERM to rank 1 alone, as soon as it handles the signal: every rank stops at the start's first
    agreement, rank 0 saves, and rank 1 (with nothing to save) exits 75 first, so torchrun's agent sends rank 0
    its own SIGTERM while rank 0 tears down (process group, lock, last line). Handlers restored before that
    teardown let the agent's SIGTERM kill rank 0 there: its "preempted" line lost, its lock left behind, and the
    next start took it over as stale, with a warning. 20 starts in a row, as the restarts of one ``ddp-service
    launch`` agent (its workers forked warm from the fork server, a fraction of a second a start instead of two
    interpreters importing torch): none warns, each is preempted, and the launch ends 75."""
    run_dir = tmp_path / "run"
    sets = (*QUICK, f"run_dir={run_dir}", *SLOW, "train.max_steps=1000", "train.epochs=100",
            "task_options.sleep=0.02", "metrics.goodput=false")  # fmt: skip
    cmd = [sys.executable, "-m", "service", "launch", "--standalone", "--nproc-per-node=2", "--max-restarts=19"]
    proc, watcher = watch([*cmd, *(item for override in sets for item in ("--set", override))])
    signalled: list[int] = []
    rank1, listed = None, set()
    try:
        for attempt in range(20):
            deadline = time.monotonic() + 60
            while True:
                # The process tree is read again whenever a process came or went (a cheap listing of /proc each
                # 10 ms, where a read of the whole tree each time cost the test ~4 s of CPU); the handler each time.
                listing = {name for name in os.listdir("/proc") if name.isdigit()}
                if listing != listed:
                    rank1, listed = worker_pids(proc.pid).get(1), listing
                if rank1 and rank1 not in signalled and catches(rank1, signal.SIGTERM):
                    break
                assert time.monotonic() < deadline and proc.poll() is None, f"start {attempt}: {watcher.text()[-3000:]}"
                time.sleep(0.01)
            os.kill(rank1, signal.SIGTERM)
            signalled.append(rank1)
        code = finish(proc, watcher)
    finally:
        kill_group(proc)
    text = watcher.text()
    assert code == 75, text[-4000:]
    assert "is stale" not in text, text[-4000:]
    for rank in (0, 1):
        assert text.count(f"[rank {rank}] WARNING preempted: stopped at step") == 20, text[-4000:]
    assert read_summary(run_dir)["status"] == "preempted", text[-4000:]
    assert not (run_dir / LOCK_NAME).exists(), "the lock was left behind"


def test_a_dangling_symlink_at_the_lock_fails_the_start_at_once_saying_what_to_remove(tmp_path):
    """Issue 15, point 8: it hung start-up at full CPU with no output."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).symlink_to(tmp_path / "elsewhere" / ".lock")
    started = time.monotonic()
    done = run_job(run_dir, 1, *SLOW, "train.max_steps=2", start="alone", expect_ok=False, timeout=90)
    assert done.returncode != 0 and time.monotonic() - started < 60
    assert f"run_dir lock {run_dir / LOCK_NAME} is a symbolic link to" in done.stdout, done.stdout[-3000:]
    assert "which does not exist, not a lock file" in done.stdout and f"rm {run_dir / LOCK_NAME}" in done.stdout
    assert " INFO step " not in done.stdout and (run_dir / LOCK_NAME).is_symlink()


def test_prune_leaves_checkpoints_of_another_lineage_alone(tmp_path):
    from service.state.checkpoint_io import candidate_steps, prune, write_checkpoint

    state = {"format": 1}
    for step in (1, 2):
        write_checkpoint(tmp_path, step, state, "0" * 64, lineage="other")
    for step in (3, 4, 5, 6):
        write_checkpoint(tmp_path, step, state, "0" * 64, lineage="mine")
    prune(tmp_path, 2, 6, {"mine"})
    assert candidate_steps(tmp_path) == [6, 5, 2, 1]


# ------------------------------------------------------------------------------------------- no orphans

HARNESS = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
ONLY_PDEATHSIG = """
import time
from service.world.orphans import set_parent_death_signal
assert set_parent_death_signal()
time.sleep(120)
"""
ONLY_WATCHDOG = """
import os, time
from service.world.orphans import ParentWatchdog
ParentWatchdog(os.getppid(), interval=0.2).start()
time.sleep(120)
"""


@pytest.mark.parametrize("child", [ONLY_PDEATHSIG, ONLY_WATCHDOG], ids=["pdeathsig-alone", "watchdog-alone"])
def test_each_orphan_mechanism_alone_ends_the_child_when_its_parent_is_killed(child):
    parent = subprocess.Popen([sys.executable, "-c", HARNESS, child], cwd=REPO, env=child_env(),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        pid = int(parent.stdout.readline())
        time.sleep(1.5)  # let the child arm its mechanism
        assert not gone(pid)
        parent.kill()
        parent.wait()
        print(f"child gone {wait_gone([pid], 5):.2f} s after its parent")
    finally:
        kill_group(parent)


def test_workers_of_a_sigkilled_agent_stop_free_their_ports_and_save_nothing_more(tmp_path):
    run_dir, port = tmp_path / "run", free_ports(2)
    job = (*SLOW, "train.max_steps=400", "train.epochs=100", "checkpoint.every_steps=1", "task_options.sleep=0.05",
           f"metrics.port={port}")  # fmt: skip
    proc, watcher = start(run_dir, 2, *job)
    try:
        watcher.wait_for(r"checkpoint saved: .*step-00000003\.pt", timeout=120)
        workers = worker_pids(proc.pid)
        assert set(workers) == {0, 1}
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)  # the agent only: its workers live in sessions of their own
        proc.wait()
        took = wait_gone(list(workers.values()), 5)
    finally:
        kill_group(proc)
    print(f"workers gone {took:.2f} s after the agent")
    # Nobody listens there within a few seconds. A worker SIGKILLed inside fsync (a checkpoint every step here)
    # keeps its descriptors until the call returns, so poll. SO_REUSEADDR, as the metrics server binds: the
    # job's own connections may have left a TIME_WAIT on that port number, which is no listener.
    for local_rank in (0, 1):
        deadline = time.monotonic() + 5
        while True:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port + local_rank))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(0.1)
    time.sleep(1.0)
    created = [json.loads(path.read_text())["created"] for path in (run_dir / "checkpoints").glob("step-*.json")]
    assert created and max(created) < killed_at + 0.5  # nothing saved after the agent was gone
    assert "preempted" not in watcher.text()  # SIGKILL, not the preemption path


# ------------------------------------------------------------------------------------------- train.nonfinite

NAN = ("task=nan_tasks:nan_at", "task_options.steps=[3]", "train.max_steps=8", "train.epochs=10",
       "checkpoint.every_steps=2", "train.log_every=4")  # fmt: skip


def test_nonfinite_stop_fails_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    done = run_job(run_dir, 1, *NAN, start="alone", expect_ok=False)
    assert done.returncode != 0
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["stopped_at_step"] == 4
    message = summary["error"]
    assert "NonfiniteError: The gradient norm at step 3 is not finite" in message
    assert f"The last good checkpoint is {run_dir / 'checkpoints' / 'step-00000002.pt'}" in message
    assert "train.nonfinite=skip" in message
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == ["step-00000002.pt"]  # no nan save


def test_nonfinite_skip_skips_the_update_and_counts_it(tmp_path):
    run_dir = tmp_path / "run"
    done = run_job(run_dir, 1, *NAN, "task_options.steps=[3,5]", "train.nonfinite=skip", start="alone")
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["nonfinite_steps"] == 2
    assert summary["final_loss"] == summary["final_loss"]  # finite: the nan steps never reached the weights
    assert "step 3: the gradient norm is nan; its update is skipped" in done.stdout


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_a_fork_server_worker_watches_its_agent_and_ends_when_it_dies(pidfd, monkeypatch):
    """#26.2: a worker forked by launch's fork server cannot use its parent's death (the fork server lives as long
    as its workers): AgentWatchdog wakes when the agent process exits, on its pidfd or by polling."""
    from service.world.orphans import AgentWatchdog

    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    agent = subprocess.Popen(["sleep", "60"])
    orphaned = []
    watchdog = AgentWatchdog(agent.pid, interval=0.05, on_orphan=lambda: orphaned.append(time.monotonic())).start()
    try:
        time.sleep(0.3)
        assert orphaned == []  # alive: nothing
        killed = time.monotonic()
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 3
        while not orphaned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orphaned and orphaned[0] - killed < 1.0
    finally:
        watchdog.stop()
        agent.kill()
