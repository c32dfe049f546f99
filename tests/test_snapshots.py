"""In-memory snapshots (service/state/snapshot.py): whose area is whose, what a torn or foreign snapshot does,
and that the background copy holds the state of the step it was taken at.

The end-to-end runs (a worker SIGKILL under --standalone, a lost node under etcd3) are in
tests/test_resume_e2e.py and tests/rendezvous/test_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, child_env, read_summary, run_job

from service.config import JobConfig
from service.state.checkpoint_io import FORMAT, load_state, scan, write_checkpoint
from service.state.resume import agree_on_checkpoint, config_hash
from service.state.snapshot import Area, SnapshotWriter, build_snapshots, node_area

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
    assert isinstance(build_snapshots(base, 1, 0, HASH, "L", False), SnapshotWriter)  # a node's local rank 0
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
    writer = SnapshotWriter(area, 1, HASH, "L", cuda=False)
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
    saved = load_state(snapshots[0][1], "snapshot")
    for key, value in expected[step].items():
        assert torch.equal(saved["model"][key], value), key
    assert saved["optimizer"]["state"][1]["step"].item() == step  # the linear weight (big has no gradient)
    assert writer.written + writer.skipped == 5 and writer.written >= 1
    writer.discard()
    assert not area.path.exists()


def test_with_snapshot_every_three_only_every_third_step_is_snapshotted(tmp_path):
    """checkpoint.snapshot_every=N takes the state of steps N, 2N, ... (the other tests and the real runs use 1)."""
    writer = SnapshotWriter(area_for(tmp_path), 3, HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    taken: list[int] = []

    def state(step: int) -> dict:
        taken.append(step)
        return state_at(step)

    for step in range(1, 8):
        writer.capture(step, lambda step=step: state(step))
        deadline = time.monotonic() + 10
        while writer.written < len(taken) and time.monotonic() < deadline:  # each one written before the next step
            time.sleep(0.005)
    writer.close()
    assert taken == [3, 6] and (writer.written, writer.skipped) == (2, 0)
    assert [manifest.step for manifest, _ in scan(writer.area.path)] == [6]


def test_too_little_shared_memory_turns_snapshots_off_with_a_warning_naming_the_fix(small_fs, caplog):
    root = small_fs(size="1m")
    writer = SnapshotWriter(area_for(root), 1, HASH, "L", cuda=False)
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
    writer = SnapshotWriter(area, 1, "0" * 64, "L", cuda=False)
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
        Path(results, f"rank{rank}.json").write_text(json.dumps({**resumed.describe(), "w": weights}))
    finally:
        dist.destroy_process_group()


def test_a_node_without_the_newest_snapshot_receives_it_from_a_peer_and_says_so(tmp_path):
    """Rank 0's node holds the snapshot of step 7, rank 1's only a disk checkpoint of step 3: both resume at 7."""
    plant(area_for(tmp_path / "node0"), 7)
    write_checkpoint(tmp_path / "disk1", 3, state_at(3), HASH, "L")
    (tmp_path / "results").mkdir()
    torch.multiprocessing.start_processes(_agree_as, args=(str(tmp_path), str(tmp_path / "store"),
                                          str(tmp_path / "results")), nprocs=2, start_method="spawn")  # fmt: skip
    ranks = [json.loads((tmp_path / "results" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["step"], r["source"], r["peer"]) for r in ranks] == [(7, "snapshot", None), (7, "snapshot_from_peer", 0)]
    assert ranks[0]["w"] == ranks[1]["w"] == [7.0] * 4


def test_a_job_that_fails_on_its_last_attempt_removes_its_snapshots(tmp_path):
    """nan at the 4th step under train.nonfinite=stop, no restart left: nothing on the node would read them."""
    root = tmp_path / "shm"
    done = run_job(tmp_path / "run", 1, "task=nan_tasks:nan_at", "task_options.steps=[4]", "train.nonfinite=stop",
                   "train.max_steps=8", f"checkpoint.snapshot_dir={root}", expect_ok=False)  # fmt: skip
    assert done.returncode != 0 and read_summary(tmp_path / "run")["status"] == "failed", done.stdout[-3000:]
    assert list((root / f"ddp-service-{os.getuid()}").iterdir()) == []  # made, written to, and removed


def test_a_state_the_loop_recorded_non_finite_is_never_snapshotted(tmp_path, caplog):
    """The loop hands its device record of the first bad step along (no host read per step); the writer drops it."""
    writer = SnapshotWriter(area_for(tmp_path), 1, HASH, "L", cuda=False)
    writer.preflight(torch.nn.Linear(2, 2))
    writer.capture(1, lambda: {**state_at(1), "first_bad": torch.tensor(-1)})
    writer._inflight.exception()
    writer.capture(2, lambda: {**state_at(2), "first_bad": torch.tensor(2)})
    writer.capture(3, lambda: {**state_at(3), "first_bad": torch.tensor(2)})
    writer.close()
    assert [manifest.step for manifest, _ in scan(writer.area.path)] == [1] and not writer.enabled
    assert "the gradient norm at step 2 was not finite" in caplog.text
    assert "first_bad" not in load_state(next(scan(writer.area.path))[1], "snapshot")
