"""In-memory snapshots (service/state/snapshot.py): whose area is whose, what a torn or foreign snapshot does,
and that the background copy holds the state of the step it was taken at.

The end-to-end runs (a worker SIGKILL under --standalone, a lost node under etcd3) are in
tests/test_resume_e2e.py and tests/rendezvous/test_e2e.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import QUICK, REPO, child_env, read_summary, run_job
from hypothesis import example, given, settings
from hypothesis import strategies as st

from service.config import JobConfig
from service.state.checkpoint_io import (
    FORMAT,
    load_state,
    manifest_name,
    read_verified,
    scan,
    state_name,
    write_checkpoint,
)
from service.state.manifest import CHECKSUMS, save_without_crc32
from service.state.resume import agree_on_checkpoint, config_hash
from service.state.snapshot import Area, SnapshotWriter, build_snapshots, node_area
from service.state.snapshot_interval import (
    AGREE,
    BUDGET,
    MOST,
    SMALL_SECONDS,
    SMALL_SHARE,
    SnapshotSchedule,
    check_period,
    interval_for,
    propose,
    small,
    typical_cost,
)
from service.world.distributed import largest_across

HASH = config_hash(JobConfig())


@pytest.fixture(autouse=True)
def _service_logs_reach_caplog(monkeypatch):
    monkeypatch.setattr(logging.getLogger("service"), "propagate", True)


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def state_at(step: int, model: torch.nn.Module | None = None) -> dict:
    return {
        "format": FORMAT,
        "model": (model.state_dict() if model is not None else {"w": torch.full((4,), float(step))}),
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
        "scheduler": {"last_epoch": step},
        "loop": {"epoch": 0, "global_step": step, "samples_seen": 0, "epochs_completed": 0, "cursor": 0},
        "rng": {"torch": torch.get_rng_state()},
        "config": JobConfig().model_dump(mode="json"),
        "lineage": "L",
    }


def area_for(root: Path, run_id: str = "job-1", agent: int = 4242) -> Area:
    area = node_area(str(root), str(root / "run"), run_id, host="node-a", agent=agent)
    assert area is not None
    return area


def test_each_job_agent_and_run_dir_has_its_own_area_and_a_job_without_run_id_none(tmp_path):
    base = area_for(tmp_path)
    others = [area_for(tmp_path, run_id="job-2"), area_for(tmp_path, agent=4243),
              node_area(str(tmp_path), str(tmp_path / "other-run"), "job-1", host="node-a", agent=4242)]  # fmt: skip
    assert len({base.path, *(other.path for other in others if other)}) == 4
    assert base.path.parent.name == f"ddp-service-{os.getuid()}"
    assert node_area(str(tmp_path), str(tmp_path / "run"), None) is None
    for on in (1, "auto"):
        assert isinstance(build_snapshots(base, on, 0, HASH, "L", False), SnapshotWriter)  # a node's local rank 0
    for others in (build_snapshots(base, 1, 1, HASH, "L", False), build_snapshots(None, 1, 0, HASH, "L", False),
                   build_snapshots(base, 0, 0, HASH, "L", False)):  # fmt: skip
        assert not isinstance(others, SnapshotWriter)


def plant(area: Area, step: int, owner: dict | None = None) -> None:
    """A complete, valid snapshot of ``step`` in ``area``, its marker naming ``owner`` (default: the area's job)."""
    area.prepare()
    (area.path / "job.json").write_text(json.dumps(owner or area.owner))
    write_checkpoint(area.path, step, state_at(step), HASH, "L")


def test_snapshots_of_another_job_or_an_unsafe_area_are_never_loaded(tmp_path, world_of_one, caplog):
    disk = tmp_path / "checkpoints"
    write_checkpoint(disk, 2, state_at(2), HASH, "L")
    ours = area_for(tmp_path)
    plant(area_for(tmp_path, run_id="job-2"), 50)  # another job's leftovers on this node: another name
    plant(ours, 40, owner={**ours.owner, "run_id": "job-0"})  # our name, another job's marker
    resumed = agree_on_checkpoint(disk, 0, 1, world_of_one, "auto", snapshots=ours.readable())
    assert resumed is not None and (resumed.step, resumed.source) == (2, "disk")
    assert "names another job" in caplog.text

    ours.remove()
    plant(ours, 40)
    os.chmod(ours.path, 0o755)  # readable by others: not an area this service made
    assert ours.readable() is None and "mode 0700" in caplog.text
    os.chmod(ours.path, 0o700)
    assert ours.readable() == ours.path
    resumed = agree_on_checkpoint(disk, 0, 1, world_of_one, "auto", snapshots=ours.readable())
    assert resumed is not None and (resumed.step, resumed.source, resumed.disk_step) == (40, "snapshot", None)
    assert resumed.describe()["source"] == "snapshot"
    # resume=never reads only this job's lineage, in memory as on disk
    assert agree_on_checkpoint(disk, 0, 1, world_of_one, "never", "other", ours.readable()) is None
    # a disk checkpoint of the same step holds the same state: the snapshot is read, from memory, and the summary
    # says so (the disk one wins only when newer)
    write_checkpoint(disk, 40, state_at(40), HASH, "L")
    resumed = agree_on_checkpoint(disk, 0, 1, world_of_one, "auto", snapshots=ours.readable())
    assert resumed is not None and (resumed.step, resumed.source, resumed.file.parent) == (40, "snapshot", ours.path)
    # a newer disk checkpoint wins over an older snapshot
    write_checkpoint(disk, 45, state_at(45), HASH, "L")
    resumed = agree_on_checkpoint(disk, 0, 1, world_of_one, "auto", snapshots=ours.readable())
    assert resumed is not None and (resumed.step, resumed.source) == (45, "disk")


def test_prepare_replaces_a_foreign_area_and_refuses_a_symlinked_one(tmp_path, caplog):
    ours = area_for(tmp_path)
    plant(ours, 7, owner={**ours.owner, "agent": 1})
    ours.prepare()
    assert not list(scan(ours.path)) and json.loads((ours.path / "job.json").read_text()) == ours.owner
    ours.remove()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    ours.path.symlink_to(elsewhere)
    assert ours.readable() is None and "not a directory" in caplog.text


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(4096, 2048))  # 32 MiB staged before the buffers: a slow copy
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def test_a_snapshot_holds_the_step_it_was_taken_at_though_the_next_step_runs_during_its_copy(tmp_path):
    """Buffers are copied at the boundary (the next forward moves BatchNorm's statistics); weights and optimizer
    state in the background, done before the next update: what lands in memory is that step's state, exactly."""
    torch.manual_seed(0)
    model, area = Net(), area_for(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    writer = SnapshotWriter(area, HASH, "L", cuda=False)
    writer.preflight(model)
    expected = {}
    for step in range(1, 7):  # the 6th update is not snapshotted: it runs while the 5th is being copied
        loss = model(torch.randn(16, 8)).square().mean()  # forward: BatchNorm's running stats move
        loss.backward()
        time.sleep(0.01 * (step % 2))  # some steps find the last snapshot written, some still in flight
        writer.before_update()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = {key: value.clone() for key, value in model.state_dict().items()}
        if step < 6:
            writer.capture(step, lambda step=step: {**state_at(step, model), "optimizer": optimizer.state_dict()})
    writer.close()
    snapshots = list(scan(area.path))
    assert len(snapshots) == 1  # one kept; the one before went when the next completed
    step = snapshots[0][0].step
    assert snapshots[0][0].checksum[0] == "xxh3_128"  # a snapshot's kind (issue 39, 6): sha256 is six times slower
    assert set(CHECKSUMS) & set(json.loads((area.path / manifest_name(step)).read_text())) == {"xxh3_128"}
    saved = load_state(snapshots[0][1], "snapshot")
    for key, value in expected[step].items():
        assert torch.equal(saved["model"][key], value), key
    assert saved["optimizer"]["state"][1]["step"].item() == step  # the linear weight (big has no gradient)
    assert writer.written + writer.skipped == 5 and writer.written >= 1
    writer.discard()
    assert not area.path.exists()


def test_with_snapshot_every_three_only_every_third_step_is_snapshotted(tmp_path):
    """checkpoint.snapshot_every=N takes the state of steps N, 2N, ... (the other tests and the real runs use 1):
    the schedule says which steps are due, the writer writes those."""
    schedule = SnapshotSchedule(3, 0, lambda: [], agree=lambda proposal: proposal)
    writer = SnapshotWriter(area_for(tmp_path), HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    taken: list[int] = []

    def state(step: int) -> dict:
        taken.append(step)
        return state_at(step)

    for step in range(1, 8):
        if not schedule.due(step):
            continue
        writer.capture(step, lambda step=step: state(step))
        deadline = time.monotonic() + 10
        while writer.written < len(taken) and time.monotonic() < deadline:  # each one written before the next step
            time.sleep(0.005)
    writer.close()
    assert taken == [3, 6] and (writer.written, writer.skipped) == (2, 0)
    assert [manifest.step for manifest, _ in scan(writer.area.path)] == [6]


@pytest.mark.e2e
def test_too_little_shared_memory_turns_snapshots_off_with_a_warning_naming_the_fix(small_fs, caplog):
    root = small_fs(size="1m")
    writer = SnapshotWriter(area_for(root), HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(256, 256))  # 257 KiB of weights: 1.5 MiB for two snapshots with Adam's state
    writer.capture(1, lambda: state_at(1))
    writer.close()
    assert not writer.enabled and writer.written == 0
    assert "--shm-size" in caplog.text and "checkpoint.snapshot_dir" in caplog.text


WRITER = textwrap.dedent("""
    import sys, torch
    from service.state.snapshot import SnapshotWriter, node_area
    from service.state.checkpoint_io import FORMAT
    area = node_area(sys.argv[1], sys.argv[1] + "/run", "job-1", host="node-a", agent=4242)
    model = torch.nn.Linear(4096, 4096)  # 64 MiB: a copy long enough to be killed in
    writer = SnapshotWriter(area, "0" * 64, "L", cuda=False)
    writer.preflight(model)
    for step in range(1, 1000):
        with torch.no_grad():
            model.weight.fill_(step)
        writer.before_update()
        writer.capture(step, lambda step=step: {"format": FORMAT, "model": model.state_dict(), "optimizer": {},
                       "scheduler": {}, "loop": {"global_step": step}, "rng": {}, "config": {}})
        if writer._inflight is not None:
            writer._inflight.exception()
        print(step, flush=True)
""")


@pytest.mark.e2e
def test_a_snapshot_torn_by_a_kill_mid_copy_is_never_used_and_the_one_before_it_is(tmp_path, world_of_one):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, env=child_env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    area = area_for(tmp_path)
    try:
        assert proc.stdout is not None
        while int(proc.stdout.readline() or 0) < 2:  # two complete snapshots written
            assert proc.poll() is None
        deadline = time.monotonic() + 60
        while not list(area.path.glob(".step-*.tmp")):  # the next one is being copied into memory
            assert time.monotonic() < deadline, "no snapshot in progress seen"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    torn = list(area.path.glob(".step-*.tmp"))
    assert torn, "the kill came after the copy"
    complete = [manifest.step for manifest, _ in scan(area.path)]
    assert len(complete) == 1
    resumed = agree_on_checkpoint(tmp_path / "no-disk", 0, 1, world_of_one, "auto", snapshots=area.readable())
    assert resumed is not None and resumed.step == complete[0] and resumed.source == "snapshot"
    assert torch.all(resumed.state["model"]["weight"] == complete[0])


@pytest.mark.e2e
def test_a_job_never_loads_a_leftover_snapshot_of_another_job_on_its_node(tmp_path):
    """Real run: another job's complete, newer snapshots of the same run_dir lie in the same root; the job starts at
    step 0, and completes with its own area removed."""
    run_dir, root = tmp_path / "run", tmp_path / "shm"
    for run_id, agent in (("someone-else", os.getpid()), ("none", os.getpid()), ("none", 1)):
        area = node_area(str(root), str(run_dir), run_id, agent=agent)
        assert area is not None
        plant(area, 9)
    run_job(run_dir, 1, "train.max_steps=3", f"checkpoint.snapshot_dir={root}")
    summary = read_summary(run_dir)
    assert summary["resumed_from"] is None and summary["global_step"] == 3, summary
    assert summary["snapshots"]["written"] >= 1
    assert len(list((root / f"ddp-service-{os.getuid()}").iterdir())) == 3  # the leftovers, and not ours


def _agree_as(rank: int, root: str, store: str, results: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        area = area_for(Path(root) / f"node{rank}")
        resumed = agree_on_checkpoint(Path(root) / f"disk{rank}", rank, 2, None, "auto", snapshots=area.readable())
        assert resumed is not None
        weights = resumed.state["model"]["w"].tolist()
        # Then the snapshot interval: rank 0 writes its node's snapshots (200 ms each, 100 ms a step: every 200), the
        # other writes none (it proposes 0, and steps faster); one all-reduce.
        costs = [(0.0, 0.3), (0.0, 0.2), (0.0, 0.2)] if rank == 0 else []
        clock = Clock(0.1 if rank == 0 else 0.05)
        schedule = SnapshotSchedule("auto", resumed.step, lambda: costs, agree=largest_across(None), clock=clock,
                                    cpu_clock=lambda: clock.now)  # fmt: skip
        due = run_schedule(schedule, clock, range(resumed.step + 1, 1001))
        Path(results, f"rank{rank}.json").write_text(json.dumps({**resumed.describe(), "w": weights,
                                                                 "every": schedule.every, "due": due}))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_a_node_without_the_newest_snapshot_receives_it_from_a_peer_and_both_agree_on_one_snapshot_interval(tmp_path):
    """Rank 0's node holds the snapshot of step 7, rank 1's only a disk checkpoint of step 3: both resume at 7. Then
    every rank takes the largest rank's choice of snapshot interval, in one collective: they gather and snapshot at
    the same steps."""
    plant(area_for(tmp_path / "node0"), 7)
    write_checkpoint(tmp_path / "disk1", 3, state_at(3), HASH, "L")
    (tmp_path / "results").mkdir()
    torch.multiprocessing.start_processes(_agree_as, args=(str(tmp_path), str(tmp_path / "store"),
                                          str(tmp_path / "results")), nprocs=2, start_method="spawn")  # fmt: skip
    ranks = [json.loads((tmp_path / "results" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["step"], r["source"], r["peer"]) for r in ranks] == [(7, "snapshot", None), (7, "snapshot_from_peer", 0)]
    assert ranks[0]["w"] == ranks[1]["w"] == [7.0] * 4
    assert [(r["every"], r["due"]) for r in ranks] == [(400, [10, 11, 12, 13, 14, 400, 800])] * 2


@pytest.mark.e2e
def test_a_job_that_fails_on_its_last_attempt_removes_its_snapshots_and_names_the_rank_that_failed_first(tmp_path):
    """Rank 1 alone raises ValueError at its 4th step, no restart left: nothing on the node would read the snapshots.
    summary.json (rank 0's) names rank 1 and its ValueError, not the broken connection rank 0 met (issue 36)."""
    root = tmp_path / "shm"
    done = run_job(tmp_path / "run", 2, "task=nan_tasks:nan_at", "task_options.steps=[4]",
                   "task_options.raise_on_rank=1", "train.max_steps=8", f"checkpoint.snapshot_dir={root}",
                   expect_ok=False)  # fmt: skip
    summary = read_summary(tmp_path / "run")
    assert done.returncode != 0 and summary["status"] == "failed", done.stdout[-3000:]
    expected = "ValueError: rank 1 alone: bad batch at forward 4"
    assert (summary.get("failed_rank"), summary["error"]) == (1, expected), done.stdout[-3000:]
    assert f"[rank 0] ERROR rank 1 failed first: {expected}" in done.stdout, done.stdout[-3000:]
    assert list((root / f"ddp-service-{os.getuid()}").iterdir()) == []  # made, written to, and removed


def test_a_state_the_loop_recorded_non_finite_is_never_snapshotted(tmp_path, caplog):
    """The loop hands its device record of the first bad step along (no host read per step); the writer drops it."""
    writer = SnapshotWriter(area_for(tmp_path), HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    writer.capture(1, lambda: {**state_at(1), "first_bad": torch.tensor(-1)})
    writer._inflight.exception()
    writer.capture(2, lambda: {**state_at(2), "first_bad": torch.tensor(2)})
    writer.capture(3, lambda: {**state_at(3), "first_bad": torch.tensor(2)})
    writer.close()
    assert [manifest.step for manifest, _ in scan(writer.area.path)] == [1] and not writer.enabled
    assert "the gradient norm at step 2 was not finite" in caplog.text
    assert "first_bad" not in load_state(next(scan(writer.area.path))[1], "snapshot")


# --- a snapshot that fails never ends the job ---------------------------------------------------------------------

SABOTAGE = REPO / "tests" / "scripts" / "snapshot_sabotage.py"
OFF = re.compile(r"WARNING in-memory snapshots are off on this node: (.*)")


def run_sabotaged(base: Path, shm: Path, case: str, *sets: str) -> tuple[dict, str]:
    """tests/scripts/snapshot_sabotage.py under `ddp-service launch --script` (warm: its workers forked from the fork
    server, conftest.STARTS; the snapshot writer is the same either way), 2 processes, 8 steps, a snapshot due at every
    step (or none, ``checkpoint.snapshot_every=0``), its snapshots failing from step 3 on as ``case`` says."""
    cmd = [sys.executable, "-m", "service", "launch", "--nproc-per-node=2", "--max-restarts=0", "--script",
           str(SABOTAGE)]  # fmt: skip
    for override in (*QUICK, f"run_dir={base / 'run'}", f"checkpoint.snapshot_dir={shm}",
                     "train.max_steps=8", "checkpoint.snapshot_every=1", "metrics.goodput=false", *sets):  # fmt: skip
        cmd += ["--set", override]
    done = subprocess.run([*cmd, "--", case, "3"], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit {done.returncode}:\n{output[-6000:]}"
    summary = read_summary(base / "run")
    assert summary["status"] == "completed" and summary["global_step"] == 8, output[-3000:]
    return summary, output


@pytest.fixture(scope="module")
def digest_without_snapshots(tmp_path_factory: pytest.TempPathFactory) -> str:
    base = tmp_path_factory.mktemp("no-snapshots")
    summary, _ = run_sabotaged(base, base, "none", "checkpoint.snapshot_every=0")
    return summary["model_digest"]


WRITE = r"the snapshot of step \d+ could not be written into \S+/ddp-service-\d+/\w+: "


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("case", "cause"),
    [
        (
            "unpicklable",
            r"the state of step \d+ could not be serialized \(\w+Error: Can't pickle local object "
            r"'Counter\.state_dict\.<locals>\.<lambda>'\)",
        ),  # fmt: skip
        ("efbig0", WRITE + r"File too large \(EFBIG\)"),  # at its first byte
        ("efbig_mid", WRITE + r"File too large \(EFBIG\)"),  # after 64 KiB, in torch's zip writer
        ("vanish", WRITE + r"No such file or directory \(ENOENT\)"),  # not made again, with another mode
        ("readonly", WRITE + r"Read-only file system \(EROFS\)"),
        ("squatted", r"its area \S+ cannot be used \(\S+/ddp-service-\d+ is owned by uid 4242, not by this user"),
    ],
)
def test_a_snapshot_that_fails_turns_snapshots_off_with_one_warning_and_the_job_ends_as_without_them(
    tmp_path, request, case, cause, digest_without_snapshots
):
    """Issue 36: each way a snapshot fails, from step 3 on, on rank 0 (its node's writer): a kept state that cannot
    be pickled, a write that fails at its first byte or midway (RLIMIT_FSIZE: EFBIG, as a full /dev/shm gives
    ENOSPC), the area removed or made read-only under the job, a root of the areas made by another user before it.
    One warning naming the cause; nothing written after it; no file left open; the job completes with the model
    of a job without snapshots (it used to die of SIGABRT in torch's zip writer, or write on into an area it made
    anew with mode 0755)."""
    shm = request.getfixturevalue("small_fs")(size="64m") if case == "readonly" else tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    if case == "squatted":  # another user made the root first, mode 0700 (root here: uid 0 sees into it anyway)
        squat = shm / f"ddp-service-{os.getuid()}"
        squat.mkdir(mode=0o700)
        os.chown(squat, 4242, 4242)
    summary, output = run_sabotaged(tmp_path, shm, case)
    warnings = OFF.findall(output)
    assert len(warnings) == 1 and re.search(cause, warnings[0]), (warnings, output[-4000:])
    assert summary["model_digest"] == digest_without_snapshots, output[-3000:]
    assert summary["snapshots"]["written"] <= (0 if case == "squatted" else 2), summary["snapshots"]
    held = re.findall(r"rank (\d): open under \S+: (.*)", output)
    assert sorted(held) == [("0", "[]"), ("1", "[]")], output[-3000:]
    if case == "squatted":
        assert os.stat(squat).st_uid == 4242 and list(squat.iterdir()) == []  # nothing made or removed in it


FAILING_WRITES = textwrap.dedent("""
    import gc, resource, sys, torch
    from pathlib import Path
    from service.state.checkpoint_io import write_checkpoint
    directory = Path(sys.argv[1])
    big = {"format": 1, "w": torch.zeros(512, 1024)}  # 2 MiB: passes the write buffer whole, into torch's writer
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    for case, state, limit in (("unpicklable", {"f": lambda: 0, **big}, hard), ("first byte", big, 0),
                               ("midway", big, 65536)):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            write_checkpoint(directory, 1, state, "0" * 64, checksum="xxh3_128", zip_crc32=False)
        except Exception as exc:
            print(case, type(exc).__name__, flush=True)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        gc.collect()  # the failed save's frames, and torch's zip writer in them, are freed here
    print("alive", sorted(path.name for path in directory.iterdir()), flush=True)
""")


@pytest.mark.e2e
def test_a_snapshot_write_that_fails_closes_torchs_zip_writer_and_the_process_lives_on(tmp_path):
    """save_without_crc32 left torch's PyTorchFileWriter open when serialising raised: its destructor then wrote
    into the detached buffer and the process died of SIGABRT (issue 36). A state that cannot be pickled, a write
    refused at its first byte and one refused after 64 KiB: each raises, nothing is left behind, the process lives."""
    done = subprocess.run([sys.executable, "-c", FAILING_WRITES, str(tmp_path)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.splitlines() == ["unpicklable PicklingError", "first byte CheckpointWriteError",
                                        "midway CheckpointWriteError", "alive []"], done.stdout  # fmt: skip


def test_once_a_snapshot_failed_nothing_more_is_taken_and_a_state_that_raises_turns_them_off(tmp_path, caplog):
    """After a failed snapshot the next capture submits nothing (it used to submit the one it was called for); a
    state that raises while it is taken turns snapshots off too, instead of ending the step. One warning each."""
    writer = SnapshotWriter(area_for(tmp_path), HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    writer.capture(1, lambda: {**state_at(1), "f": lambda: 0})
    writer._inflight.exception()
    taken: list[int] = []
    for step in (2, 3):
        writer.capture(step, lambda step=step: taken.append(step) or state_at(step))
    writer.close()
    assert taken == [] and writer.written == 0 and not writer.enabled and not list(writer.area.path.glob("*.pt"))
    assert caplog.text.count("in-memory snapshots are off") == 1 and "could not be serialized" in caplog.text

    def broken() -> dict:
        raise RuntimeError("a state_dict that raises")

    caplog.clear()
    writer = SnapshotWriter(area_for(tmp_path, run_id="job-2"), HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    writer.capture(1, broken)
    writer.capture(2, lambda: state_at(2))
    writer.close()
    assert writer.written == 0 and not writer.enabled and caplog.text.count("in-memory snapshots are off") == 1
    assert "(RuntimeError: a state_dict that raises)" in caplog.text


def test_a_root_of_the_areas_that_is_a_file_turns_snapshots_off_naming_it_and_its_owner(tmp_path, caplog):
    root = tmp_path / f"ddp-service-{os.getuid()}"
    root.write_text("")
    area = area_for(tmp_path)
    writer = SnapshotWriter(area, HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    writer.capture(1, lambda: state_at(1))
    writer.close()
    writer.discard()
    assert area.readable() is None and not writer.enabled and root.is_file()
    assert f"{root} is a file, not a directory, owned by " in caplog.text and f"(uid {os.getuid()})" in caplog.text


SQUATTED = textwrap.dedent("""
    import logging, os, sys
    import torch
    from service.state.snapshot import SnapshotWriter, node_area
    os.setgid(65534)
    os.setuid(65534)  # a user whose root of the areas another user made first, mode 0700: not even stat-able inside
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    area = node_area(sys.argv[1], "/nonexistent/run", "job-1", host="node-a", agent=4242)
    print("readable", area.readable(), flush=True)
    writer = SnapshotWriter(area, "0" * 64, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    writer.capture(1, lambda: {})
    writer.discard()
    print("enabled", writer.enabled, flush=True)
""")


@pytest.mark.e2e
def test_a_root_of_the_areas_another_user_made_first_turns_snapshots_off_instead_of_failing_the_start(tmp_path):
    """Issue 36: /dev/shm is writable by every local user; one that makes /dev/shm/ddp-service-<uid> first (mode
    0700) made Path.exists() raise PermissionError in Runtime.__init__. Run as uid 65534 (the suite runs as root,
    which sees into any directory): no error, snapshots off, one warning naming the root and its owner."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a directory as one user and run as another")
    base = Path(tempfile.mkdtemp(prefix="squatted-", dir="/tmp"))
    try:
        os.chmod(base, 0o1777)  # as /dev/shm
        root = base / "ddp-service-65534"
        root.mkdir(mode=0o700)
        os.chown(root, 4242, 4242)
        done = subprocess.run([sys.executable, "-c", SQUATTED, str(base)], cwd="/", env=child_env(),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == ["readable None", "enabled False"], done.stdout + done.stderr[-3000:]
        assert done.stderr.count("in-memory snapshots are off") == 1, done.stderr
        assert f"{root} is owned by uid 4242, not by this user" in done.stderr, done.stderr
        assert list(root.iterdir()) == [] and os.stat(root).st_uid == 4242
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- the checksum kinds -------------------------------------------------------------------------------------------


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("kind", "zip_crc32"), [("sha256", True), ("xxh3_128", True), ("xxh3_128", False)])
def test_each_checksum_kind_round_trips_and_catches_a_flipped_byte(tmp_path, kind, zip_crc32):
    """A manifest names the kind it was written with, and only that one; the state reads back equal; one flipped
    bit of the state file is caught by that kind's check."""
    state = state_at(5, torch.nn.Linear(64, 64))
    manifest = write_checkpoint(tmp_path, 5, state, HASH, "L", checksum=kind, zip_crc32=zip_crc32)
    written = json.loads((tmp_path / manifest_name(5)).read_text())
    assert manifest.checksum[0] == kind and kind in written
    assert [name for name in CHECKSUMS if name in written] == [kind]  # one kind named, no null for the other
    checked, payload = read_verified(tmp_path, 5)
    assert checked.checksum == manifest.checksum and len(payload) == manifest.size
    loaded = load_state(payload, "the checkpoint")
    assert all(torch.equal(loaded["model"][key], value) for key, value in state["model"].items())
    flip_byte(tmp_path / state_name(5))
    with pytest.raises(ValueError, match=f"does not match the {kind} in its manifest"):
        read_verified(tmp_path, 5)


class Paused(io.RawIOBase):
    """A file whose first write waits to be released: a save held in the middle of its archive."""

    def __init__(self) -> None:
        self.entered, self.released, self.data = threading.Event(), threading.Event(), bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.entered.set()
        self.released.wait(30)
        self.data += bytes(data)
        return len(memoryview(data).cast("B"))


def test_a_snapshot_has_no_zip_crc32_and_a_disk_checkpoint_written_meanwhile_keeps_its_own(tmp_path):
    """A snapshot leaves torch.save's crc32 out per call: a disk checkpoint written while a snapshot is being
    serialised (the async checkpointer's thread) still gets a zip archive whose every record's crc32 checks, and the
    process's torch.save setting is untouched. (The process-wide switch, set_crc32_options, fails this.)"""
    state = state_at(3, torch.nn.Linear(64, 64))
    held = Paused()
    thread = threading.Thread(target=save_without_crc32, args=(state, held))
    thread.start()
    try:
        assert held.entered.wait(30)
        write_checkpoint(tmp_path / "disk", 3, state, HASH, "L")  # meanwhile, a disk checkpoint
        assert torch.serialization.get_crc32_options() is True
    finally:
        held.released.set()
        thread.join()
    assert zipfile.ZipFile(tmp_path / "disk" / state_name(3)).testzip() is None  # every record's crc32 checks
    assert zipfile.ZipFile(io.BytesIO(bytes(held.data))).testzip() is not None  # the first record lacks its crc32
    write_checkpoint(tmp_path / "snap", 3, state, HASH, "L", checksum="xxh3_128", zip_crc32=False)
    assert zipfile.ZipFile(tmp_path / "snap" / state_name(3)).testzip() is not None
    for loaded in (torch.load(io.BytesIO(bytes(held.data)), weights_only=True),
                   load_state(read_verified(tmp_path / "snap", 3)[1], "the snapshot")):  # fmt: skip
        assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])


# A manifest exactly as the service wrote it before the checksum kinds (sha256 required, no other kind).
OLD_MANIFEST = """{
  "format": 1,
  "step": 4,
  "file": "step-00000004.pt",
  "size": SIZE,
  "sha256": "SHA256",
  "config_hash": "HASH",
  "torch": "2.13.0+cpu",
  "service": "0.1.0",
  "created": 1760000000.0,
  "lineage": "L"
}"""


def test_an_old_sha256_manifest_still_loads_and_a_disk_checkpoint_still_writes_one(tmp_path, world_of_one):
    """A checkpoint of an earlier version resumes; and a disk checkpoint's manifest has the old fields only, so an
    earlier version (whose manifest forbids unknown fields) still reads it."""
    buffer = io.BytesIO()
    torch.save(state_at(4), buffer)
    payload = buffer.getvalue()
    (tmp_path / state_name(4)).write_bytes(payload)
    old = OLD_MANIFEST.replace("SIZE", str(len(payload))).replace("SHA256", hashlib.sha256(payload).hexdigest())
    (tmp_path / manifest_name(4)).write_text(old.replace("HASH", HASH))
    resumed = agree_on_checkpoint(tmp_path, 0, 1, world_of_one, "auto")
    assert resumed is not None and resumed.step == 4 and resumed.state["model"]["w"].tolist() == [4.0] * 4
    write_checkpoint(tmp_path, 6, state_at(6), HASH, "L")
    assert set(json.loads((tmp_path / manifest_name(6)).read_text())) == set(json.loads(old))


@pytest.mark.parametrize("named", [(), ("sha256", "xxh3_128")], ids=["none", "two"])
def test_a_manifest_naming_no_checksum_or_two_is_refused_with_the_reason(tmp_path, named, caplog):
    payload = b"PK\x03\x04 not read"
    (tmp_path / state_name(4)).write_bytes(payload)
    digests = {"sha256": hashlib.sha256(payload).hexdigest(), "xxh3_128": "0" * 32}
    manifest = json.loads(OLD_MANIFEST.replace("SIZE", str(len(payload))).replace("HASH", HASH))
    del manifest["sha256"]
    (tmp_path / manifest_name(4)).write_text(json.dumps({**manifest, **{kind: digests[kind] for kind in named}}))
    with pytest.raises(ValueError) as info:
        read_verified(tmp_path, 4)
    reason = str(info.value)
    assert "is not valid" in reason and "names exactly one checksum of its state file (sha256 or xxh3_128)" in reason
    assert f"this one names {' and '.join(named) or 'none'}" in reason, reason
    with caplog.at_level(logging.WARNING):
        assert list(scan(tmp_path)) == []  # skipped with that warning, never loaded
    assert "names exactly one checksum" in caplog.text


# --- checkpoint.snapshot_every: auto ------------------------------------------------------------------------------


class Clock:
    """Time that moves only when a step is run: ``step_time`` seconds a step."""

    def __init__(self, step_time: float) -> None:
        self.now, self.step_time = 0.0, step_time

    def __call__(self) -> float:
        return self.now


def run_schedule(schedule: SnapshotSchedule, clock: Clock, steps: range) -> list[int]:
    """The steps at which ``schedule`` says a snapshot is due, one boundary per step, ``clock`` moving between."""
    due = []
    for step in steps:
        clock.now += clock.step_time
        if schedule.due(step):
            due.append(step)
    return due


def test_auto_times_clean_steps_probes_every_step_then_agrees_on_a_longer_interval_for_a_slower_snapshot():
    """Steps 101-102 of a start at 100 are timed with no snapshot; 103-107 take one every step; at 108 the rank
    proposes the shortest interval that keeps its snapshots at 0.5% of the step time (every step for a small one),
    and the agreed one is used; the re-checks after it find nothing moved and repeat that proposal."""
    chosen = {}
    for name, background in (("tiny", 0.0006), ("small", 0.010), ("slow", 0.19)):
        costs = [(0.001, 0.5), (0.0005, background), (0.0005, background * 1.2)]  # the first: buffers allocated
        proposals: list[int] = []
        clock = Clock(0.1)
        schedule = SnapshotSchedule("auto", 100, lambda costs=costs: costs,
                                    agree=lambda p, proposals=proposals: proposals.append(p) or p, clock=clock,
                                    cpu_clock=lambda clock=clock: clock.now * 2, cpus=2)  # fmt: skip
        due = run_schedule(schedule, clock, range(101, 2001))
        assert due[:5] == [103, 104, 105, 106, 107] and 101 not in due and 102 not in due
        checks = list(range(108 + check_period(schedule.every), 2001, check_period(schedule.every)))
        assert len(proposals) == 1 + len(checks) and len(set(proposals)) == 1  # at 108, then the same at each check
        assert schedule.intervals == [{"from_step": 103, "every": 1}] + (
            [{"from_step": 108, "every": schedule.every}] if schedule.every != 1 else []
        )
        assert all(step >= 108 and step % schedule.every == 0 for step in due[5:])
        assert schedule.step_time == pytest.approx(0.1) and schedule.busy == pytest.approx(1.0)
        assert schedule.cost == pytest.approx(0.0005 + background * 1.1)  # the median, the first left out
        chosen[name] = (proposals[0], schedule.every, due[5:])
    assert chosen["tiny"][:2] == (1, 1)  # 1.16 ms: a small snapshot (20 ms or less, 10% of the step or less)
    assert chosen["small"][:2] == (23, 23)  # 11.5 ms / 23 <= 0.5% of 100 ms; 11.5 ms / 22 is not
    assert chosen["slow"][:2] == (419, 419) and chosen["slow"][2] == [419 * k for k in range(1, 5)]


def test_a_snapshot_costs_the_steps_its_background_cpu_only_in_the_share_the_training_keeps_busy():
    """The same snapshot (1 ms on the training thread, 500 ms of background CPU) at a 1 s step: on a node whose CPUs
    all train it costs 501 ms (every 101 steps); where the training keeps a tenth of them busy (a GPU node's host),
    51 ms (every 11); the ranks on a node share its CPUs; at a fortieth, 13.5 ms: a small snapshot, every step."""
    costs = [(0.001, 0.5)] * 3
    for cpu_per_second, ranks_here, cpus, every in ((4.0, 1, 4, 101), (0.4, 1, 4, 11), (0.5, 8, 4, 101),
                                                    (0.2, 2, 16, 1)):  # fmt: skip
        clock = Clock(1.0)
        schedule = SnapshotSchedule(
            "auto",
            0,
            lambda: costs,
            agree=lambda p: p,
            ranks_here=ranks_here,
            cpus=cpus,
            clock=clock,
            cpu_clock=lambda clock=clock, rate=cpu_per_second: clock.now * rate,
            max_seconds=600,
        )
        run_schedule(schedule, clock, range(1, AGREE + 1))
        assert schedule.busy == pytest.approx(min(1.0, cpu_per_second * ranks_here / cpus))
        assert schedule.every == every, (cpu_per_second, ranks_here, cpus, schedule.cost)


def test_auto_takes_another_ranks_larger_choice_and_a_rank_without_snapshots_proposes_none():
    proposals: list[int] = []
    clock = Clock(0.1)
    schedule = SnapshotSchedule("auto", 0, lambda: [], agree=lambda p: proposals.append(p) or max(p, 30), clock=clock)
    due = run_schedule(schedule, clock, range(1, 121))
    assert proposals == [0, 0] and schedule.every == 30 and due == [3, 4, 5, 6, 7, 30, 60, 90, 120]  # at 8 and 72
    off = SnapshotSchedule("auto", 0, lambda: [], agree=lambda p: p, clock=clock)  # no rank keeps any
    assert run_schedule(off, clock, range(1, 200)) == [3, 4, 5, 6, 7] and off.every == 0


class Steps:
    """A simulated clock whose steps take ``times(step)`` seconds; the process's CPU keeps pace (busy share 1)."""

    def __init__(self, times: Callable[[int], float]) -> None:
        self.now, self.times = 0.0, times

    def __call__(self) -> float:
        return self.now


def run_timed(schedule: SnapshotSchedule, clock: Steps, steps: range) -> list[int]:
    due = []
    for step in steps:
        clock.now += clock.times(step)
        if schedule.due(step):
            due.append(step)
    return due


class UnevenClock(Clock):
    """Steps of ``step_time`` seconds, but step ``slow`` (a step number; 0: none) takes ``slow_time``: an evaluation,
    a checkpoint, a straggler's hiccup."""

    def __init__(self, step_time: float, slow: int = 0, slow_time: float = 0.0) -> None:
        super().__init__(step_time)
        self.slow, self.slow_time = slow, slow_time


def run_uneven(schedule: SnapshotSchedule, clock: UnevenClock, steps: range) -> list[int]:
    """As :func:`run_schedule`, with step ``clock.slow`` taking ``clock.slow_time``."""
    due = []
    for step in steps:
        clock.now += clock.slow_time if step == clock.slow else clock.step_time
        if schedule.due(step):
            due.append(step)
    return due


def auto(clock: Steps, costs: list, start: int = 0, **kwargs) -> SnapshotSchedule:
    """auto on one rank (its proposal is the agreed interval), on ``clock``, with these measured ``costs``."""
    return SnapshotSchedule("auto", start, lambda: costs, agree=lambda p: p, clock=clock, cpu_clock=clock, **kwargs)


def test_auto_picks_the_same_interval_after_a_slow_a_near_empty_or_a_steady_start():
    """The issue's starts: 3 slow first steps (1 s, then 111 ms steps) chose every 2 against 20 unskewed, and 2
    near-empty first steps chose every 9,924 ("a step takes 0 ms"). The steady steps decide now: all three starts
    agree at step 8 on the interval of 111 ms steps, and keep it."""
    costs = [(0.002, 0.02)] * 6  # 22 ms a snapshot: 0.5% of 111 ms is 0.555 ms, so every 40
    starts = {"steady": lambda step: 0.111, "slow": lambda step: 1.0 if step <= 3 else 0.111,
              "near-empty": lambda step: 1e-5 if step <= 2 else 0.111}  # fmt: skip
    chosen = {}
    for name, times in starts.items():
        clock = Steps(times)
        schedule = auto(clock, costs)
        run_timed(schedule, clock, range(1, AGREE + 1))
        first = schedule.every
        run_timed(schedule, clock, range(AGREE + 1, 2001))
        chosen[name] = (first, schedule.every, schedule.step_time, schedule.intervals)
    assert chosen["steady"][:3] == (40, 40, 0.111), chosen
    assert chosen["slow"] == chosen["near-empty"] == chosen["steady"]
    assert chosen["steady"][3] == [{"from_step": 3, "every": 1}, {"from_step": 8, "every": 40}]


def test_steps_whose_body_did_not_run_are_left_out_even_when_they_take_some_time():
    """A step with no forward (the count ``ran`` did not move: a loop that skipped its body) sets no step time, even
    at a third of a real step; a step with one sets it (the shortest of the steady steps)."""
    costs = [(0.002, 0.02)] * 6
    forwards = {"count": 0}

    def times(step: int) -> float:
        forwards["count"] += step > 3  # steps 1-3 run no forward; they take 37 ms
        return 0.037 if step <= 3 else 0.111

    clock = Steps(times)
    schedule = auto(clock, costs, ran=lambda: forwards["count"])
    run_timed(schedule, clock, range(1, AGREE + 1))
    assert schedule.step_time == 0.111 and schedule.every == 40
    blind = Steps(lambda step: 0.037 if step <= 3 else 0.111)  # nothing known of the bodies: the time decides
    schedule = auto(blind, costs)
    run_timed(schedule, blind, range(1, AGREE + 1))
    assert schedule.step_time == 0.037 and schedule.every == 119


def test_a_slow_step_among_fast_steady_ones_does_not_set_the_interval():
    """An evaluation every 10 steps (2 s, against 111 ms steps) never sets the step time: the shortest steady one
    does, at the start and at every re-check."""
    clock = Steps(lambda step: 2.0 if step % 10 == 0 else 0.111)
    schedule = auto(clock, [(0.002, 0.02)] * 6)
    run_timed(schedule, clock, range(1, 3001))
    assert schedule.step_time == 0.111 and schedule.intervals == [{"from_step": 3, "every": 1},
                                                                  {"from_step": 8, "every": 40}]  # fmt: skip


def test_a_mid_run_slowdown_or_a_costlier_snapshot_moves_the_interval_and_says_why(caplog):
    caplog.set_level(logging.INFO, logger="service")
    """Steps slow from 10 ms to 100 ms at step 1000 (10x): the interval moves at the next check, to what 100 ms steps
    give from the start. Then the snapshots cost 3x as much: it moves again. A 1.5x change moves nothing."""
    cost = {"now": 0.05}  # 50 ms a snapshot: at 10 ms steps the time ceiling (60 s = 6,000 steps) binds

    def times(step: int) -> float:
        return 0.01 if step < 1000 else 0.15 if step >= 5000 else 0.1

    clock = Steps(times)
    costs: list = []
    schedule = SnapshotSchedule("auto", 0, lambda: costs, agree=lambda p: p, clock=clock, cpu_clock=clock)
    for step in range(1, 12_001):
        clock.now += times(step)
        costs.append((0.0, cost["now"]))
        if step == 3000:
            cost["now"] = 0.15
        schedule.due(step)
        if step == 999:
            before = schedule.every
        if step == 2999:
            slowed = schedule.every
    assert before == 1000  # 50 ms / 1000 = 0.05 ms, 0.5% of 10 ms
    steady = Steps(lambda step: 0.1)
    fresh = auto(steady, [(0.0, 0.05)] * 6)
    run_timed(fresh, steady, range(1, AGREE + 1))
    assert slowed == fresh.every == 100
    assert schedule.every == 300  # 150 ms a snapshot at 100 ms steps; the 1.5x slower steps from 5000 move nothing
    moves = [record["from_step"] for record in schedule.intervals]
    assert moves[:2] == [3, 8] and 1000 < moves[2] <= 1000 + check_period(1000) and 3000 < moves[3] <= 3000 + 64
    assert len(moves) == 4, schedule.intervals
    lines = [r.getMessage() for r in caplog.records if "keeps measuring" in r.getMessage()]
    assert len(lines) == 2 and "a step 10.0 ms -> 100.0 ms" in lines[0], lines
    assert "a change of more than 2x" in lines[0] and "a change of more than 2x" in lines[1], lines
    assert "not 1000" in lines[0] and "a snapshot 50.0 ms -> 150.0 ms" in lines[1], lines


def test_the_time_ceiling_bounds_what_one_failure_loses_in_seconds():
    """A 2 s snapshot at 100 ms steps would be every 4,000 steps (400 s) by its budget: the ceiling, 60 s by default
    (checkpoint.snapshot_max_seconds), makes it every 600; at 5 s it is every 50; at 20 s steps, every 3; where one
    step is longer than the ceiling, every step."""
    for max_seconds, step_time, every in ((60, 0.1, 600), (5, 0.1, 50), (60, 20.0, 3), (10, 20.0, 1)):
        clock = Steps(lambda step, step_time=step_time: step_time)
        schedule = auto(clock, [(0.0, 2.0)] * 6, max_seconds=max_seconds)
        due = run_timed(schedule, clock, range(1, 2001))
        assert schedule.every == every, (max_seconds, step_time, schedule.every)
        late = [step for step in due if step > AGREE]
        assert all((b - a) * step_time <= max(max_seconds, step_time) for a, b in zip(late, late[1:], strict=False))


def test_a_small_snapshot_is_taken_every_step_also_under_load():
    """The built-in task's figures (2.1 ms a snapshot, 46 ms steps: every 10 at 0.5%) give every step; under load
    the steps slow and the busy share falls, so it stays every step."""
    # idle; a loaded node: slower steps and a slower boundary, less CPU each
    for step_time, rate, cost in ((0.046, 1.0, (0.0011, 0.0017)), (0.16, 0.3, (0.0038, 0.0017))):
        clock = Steps(lambda step, step_time=step_time: step_time)
        schedule = SnapshotSchedule("auto", 0, lambda cost=cost: [cost] * 6, agree=lambda p: p, clock=clock,
                                    cpu_clock=lambda clock=clock, rate=rate: clock.now * rate)  # fmt: skip
        assert run_timed(schedule, clock, range(1, 501)) == list(range(3, 501))
        assert schedule.every == 1 and schedule.intervals == [{"from_step": 3, "every": 1}]


def test_the_re_checks_read_the_snapshots_done_and_never_wait_for_one_in_flight(tmp_path):
    """The first agreement waits for the probe's last snapshot (once a start); the re-checks read what is done: a
    64 MiB snapshot just taken is not waited for by ``recent``, and ``measured`` waits for it."""
    model = torch.nn.Linear(4096, 4096)
    writer = SnapshotWriter(area_for(tmp_path), HASH, "L", cuda=False)
    writer.preflight(model)
    writer.capture(1, lambda: {**state_at(1), "model": model.state_dict()})
    assert writer.recent() == [] and writer.written == 0  # in flight: nothing waited for
    assert len(writer.measured()) == 1 and writer.written == 1
    writer.close()
    calls = {"costs": 0, "recent": 0}

    def read(kind: str) -> list:
        calls[kind] += 1
        return [(0.0, 0.05)] * 6

    clock = Steps(lambda step: 0.01)
    schedule = SnapshotSchedule("auto", 0, lambda: read("costs"), agree=lambda p: p, clock=clock, cpu_clock=clock,
                                recent=lambda: read("recent"))  # fmt: skip
    run_timed(schedule, clock, range(1, 2001))
    assert calls == {"costs": 1, "recent": len(range(8 + 250, 2001, 250))}, calls


timings = st.integers(min_value=1, max_value=40_000).map(lambda k: k / 1000)  # whole ms: read back to the ns


@given(step=timings, blocked=st.floats(min_value=0.0, max_value=5.0),
       background=st.floats(min_value=0.0, max_value=50.0), max_seconds=st.floats(min_value=0.5, max_value=3600.0),
       prefix=st.lists(st.one_of(st.integers(0, 9).map(lambda k: k / 2**20),  # near-empty
                                 st.integers(1, 20)), max_size=3))  # fmt: skip
@example(step=0.005, blocked=0.0, background=1.0, max_seconds=1.9, prefix=[])  # 380 x 0.005 > 1.9 in floats
@settings(max_examples=60, deadline=None)
def test_the_interval_never_exceeds_its_ceiling_and_a_skewed_start_changes_nothing(step, blocked, background,
                                                                                    max_seconds, prefix):  # fmt: skip
    """Any steady step time, snapshot cost and ceiling, after any start of up to 3 near-empty or slow steps: the
    interval is the unskewed one, at most MOST steps and ``max_seconds`` of steps (or 1), and within the budget
    wherever the ceiling allows it (or a small snapshot, every step)."""
    costs = [(blocked, background)] * 6
    chosen = []
    for first in ([], prefix):
        times = [step * k if isinstance(k, int) else k for k in first]
        clock = Steps(lambda n, times=times: times[n - 1] if n <= len(times) else step)
        schedule = auto(clock, costs, max_seconds=max_seconds)
        run_timed(schedule, clock, range(1, 400))
        chosen.append(schedule.every)
    every = chosen[0]
    assert chosen[1] == every and 1 <= every <= MOST
    assert every == 1 or every * step <= max_seconds
    cost = blocked + background
    if not small(cost, step) and every < max_seconds // step and every < MOST:
        assert cost / every <= BUDGET * step


@pytest.mark.parametrize("slow", range(1, 2 * AGREE + 1))
def test_a_slow_step_anywhere_in_a_start_does_not_set_the_interval(slow):
    """Issue 39 (7): every auto test timed equal steps, so taking the longest timed step for the step time passed.
    Steps of 100 ms with one of 2 s anywhere in the first steps of a start (an evaluation): the interval auto agrees
    on is the one it agrees on when every step takes 100 ms (a 11.5 ms snapshot: every 23 steps), not the one a
    2 s step would give (every 2); and the snapshots are taken at its multiples."""
    costs = [(0.001, 0.5), (0.0005, 0.010), (0.0005, 0.012)]

    def agreed(clock: UnevenClock) -> tuple[int, list[int]]:
        schedule = SnapshotSchedule("auto", 0, lambda: costs, agree=lambda p: p, clock=clock,
                                    cpu_clock=lambda: clock.now)  # fmt: skip
        due = run_uneven(schedule, clock, range(1, 400))
        return schedule.every, due

    steady_every, steady_due = agreed(UnevenClock(0.1))
    assert steady_every == 23
    every, due = agreed(UnevenClock(0.1, slow, 2.0))
    assert every == steady_every, f"a 2 s step {slow} set the interval to {every}"
    assert due[-5:] == steady_due[-5:] == [23 * k for k in range(13, 18)]


@pytest.mark.parametrize(("every", "expected"), [(1, list(range(1, 13))), (4, [4, 8, 12]), (0, [])])
def test_a_fixed_snapshot_every_is_every_nth_step_with_no_timing_and_no_agreement(every, expected):
    def agree(proposal: int) -> int:
        raise AssertionError("a fixed interval needs no collective")

    schedule = SnapshotSchedule(every, 0, lambda: [(0.0, 0.5)], agree=agree, sync=lambda: agree(0))
    assert run_schedule(schedule, Clock(0.1), range(1, 13)) == expected


finite = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(cost=finite, step_time=st.floats(min_value=1e-6, max_value=1e3), slower=finite)
def test_interval_for_keeps_the_cost_within_the_budget_whenever_it_can_with_the_shortest_such_interval(
    cost, step_time, slower
):
    interval = interval_for(cost, step_time)
    allowed = BUDGET * step_time
    assert 1 <= interval <= MOST
    if cost / MOST <= allowed:  # achievable within the longest interval auto takes
        assert cost / interval <= allowed
    else:
        assert interval == MOST
    assert interval == 1 or cost / (interval - 1) > allowed  # none shorter would do
    assert interval_for(cost + slower, step_time) >= interval  # a slower snapshot: never a shorter interval


@given(nodes=st.lists(st.tuples(st.floats(min_value=1e-5, max_value=10.0), st.floats(min_value=0.0, max_value=10.0),
                                st.floats(min_value=1e-3, max_value=10.0), st.floats(min_value=0.0, max_value=1.0)),
                      min_size=1, max_size=8))  # fmt: skip
def test_the_largest_proposal_keeps_every_node_within_its_budget(nodes):
    """Each node measures its own costs, step time and busy share; the agreed (largest) interval holds every node's
    snapshots to its budget (0.5%) of its step time, or, for a small snapshot taken every step, to 10% of it."""
    proposals = [propose([(blocked, background)], step_time, busy) for blocked, background, step_time, busy in nodes]
    agreed = max(proposals)
    assert agreed >= 1
    for blocked, background, step_time, busy in nodes:
        cost = typical_cost([(blocked, background)], busy)
        if small(cost, step_time):
            assert cost / agreed <= SMALL_SHARE * step_time and cost <= SMALL_SECONDS
        elif cost / MOST <= BUDGET * step_time:
            assert cost / agreed <= BUDGET * step_time


def test_the_writer_measures_a_bigger_snapshot_as_costlier_and_auto_picks_a_longer_interval_for_it(tmp_path):
    """Real snapshots, real costs (the writer's own measure): a 64 MiB model against a tiny one, at the same
    (controlled) step time and CPU use."""
    chosen = {}
    for name, model in (("tiny", torch.nn.Linear(8, 8)), ("big", torch.nn.Linear(4096, 4096))):
        writer = SnapshotWriter(area_for(tmp_path, run_id=name), HASH, "L", cuda=False)
        writer.preflight(model)
        clock = Clock(0.5)
        schedule = SnapshotSchedule("auto", 0, writer.measured, agree=lambda p: p, clock=clock,
                                    cpu_clock=lambda clock=clock: clock.now)  # fmt: skip
        for step in range(1, AGREE + 1):
            clock.now += clock.step_time
            if schedule.due(step):
                writer.capture(step, lambda step=step, model=model: {**state_at(step), "model": model.state_dict()})
            writer.before_update()
        writer.close()
        assert writer.written >= 1 and schedule.cost is not None and schedule.cost > 0
        assert all(blocked >= 0 and background > 0 for blocked, background in writer.measured())
        chosen[name] = (schedule.cost, schedule.every)
    assert chosen["big"][0] > 5 * chosen["tiny"][0] and chosen["big"][1] > chosen["tiny"][1], chosen
