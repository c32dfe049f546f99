"""Fast tests of exact resume: the data plan, checkpoint files on disk, the checkpointer, and config checks.

Everything here runs on real files (a real tmpfs for the disk-full cases) and
the real code; nothing under test is mocked. The whole file takes seconds.
"""

from __future__ import annotations

import collections
import hashlib
import io
import itertools
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_env, fill
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from service.config import ConfigError, JobConfig, TrainConfig, load_config
from service.data.sampler import DataPlan, PlanSampler, permutation
from service.loop.train import batch_geometry, plan_total_steps
from service.state import checkpoint_io
from service.state.checkpoint import Rank0Checkpointer, archive_existing
from service.state.checkpoint_io import (
    FORMAT,
    CheckpointWriteError,
    Manifest,
    UnsafeCheckpointError,
    load_state,
    manifest_name,
    prune,
    read_verified,
    scan,
    state_name,
    write_checkpoint,
)
from service.state.loop_state import LoopState
from service.state.preemption import Preemption
from service.state.resume import config_hash, incompatible_fields

HASH = config_hash(JobConfig())
IO_LOG = "service.state.checkpoint_io"


@pytest.fixture(autouse=True)
def _service_logs_reach_caplog(monkeypatch):
    """configure_logging (if another test ran it) stops propagation; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("service"), "propagate", True)


def make_state(value: float, size: int = 4) -> dict:
    """A small state with every key a checkpoint must have; only tensors and plain containers."""
    return {
        "format": FORMAT,
        "model": {"w": torch.full((size,), float(value)), "b": torch.tensor([value])},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "scheduler": {"last_epoch": int(value)},
        "loop": {"epoch": 0, "global_step": int(value), "samples_seen": 0, "epochs_completed": 0, "cursor": 0},
        "rng": {"torch": torch.get_rng_state()},
        "config": JobConfig().model_dump(mode="json"),
    }


def newest(directory: Path) -> tuple[int, dict]:
    manifest, payload = next(scan(directory))
    return manifest.step, load_state(payload, str(directory / manifest.file))


def files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


# --------------------------------------------------------------------------------------------------
# 1. The data plan
# --------------------------------------------------------------------------------------------------

segments_strategy = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 12)), min_size=0, max_size=5)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    length=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 3),
    global_batch=st.integers(1, 40),
    micro_steps=st.integers(1, 4),
    segments=segments_strategy,
    last_world=st.integers(1, 5),
)
def test_plan_feeds_every_sample_once_across_resizes(length, seed, epoch, global_batch, micro_steps, segments,
                                                     last_world):  # fmt: skip
    """Any sequence of (world size, steps) segments, each resumed at the cursor the last one reached."""
    order = permutation(length, seed, epoch)
    losses = {index: float((index * 7919) % 101) for index in range(length)}  # any per-sample loss
    cursor, seen = 0, Counter()
    for world_size, steps in [*segments, (last_world, None)]:  # the last segment runs to the end of the epoch
        plans = [DataPlan(length, seed, global_batch, world_size, rank, micro_steps) for rank in range(world_size)]
        expected_steps = plans[0].steps_in_epoch(cursor)
        per_rank = [list(itertools.islice(plan.steps(epoch, cursor), steps)) for plan in plans]
        counts = {len(rank_steps) for rank_steps in per_rank}
        assert counts == {expected_steps if steps is None else min(steps, expected_steps)}
        for step_of_ranks in zip(*per_rank, strict=True):
            first = step_of_ranks[0]
            assert {(s.epoch, s.start, s.size) for s in step_of_ranks} == {(epoch, cursor, first.size)}
            assert first.size == min(global_batch, length - cursor) > 0
            step_indices, weight_sum, ddp_loss = [], 0.0, 0.0
            for step in step_of_ranks:
                assert len(step.micro) == micro_steps
                rank_loss = 0.0
                for batch in step.micro:
                    if batch.real == 0:  # a filler: the rank runs it to join the collectives, it never counts
                        assert batch.weight == 0.0 and len(batch.indices) == 1
                        assert batch.indices[0] in order[cursor : cursor + first.size]
                    else:
                        assert batch.real == len(batch.indices) and batch.weight > 0
                    weight_sum += batch.weight
                    mean = sum(losses[i] for i in batch.indices) / len(batch.indices)
                    rank_loss += batch.weight * mean
                ddp_loss += rank_loss / world_size  # DDP averages the ranks' gradients
                step_indices += step.indices
            assert sorted(step_indices) == sorted(order[cursor : cursor + first.size])
            assert weight_sum == pytest.approx(world_size)
            assert ddp_loss == pytest.approx(sum(losses[i] for i in step_indices) / first.size)
            seen.update(step_indices)
            assert first.end == cursor + first.size
            cursor = first.end
    assert cursor == length
    assert seen == Counter(order) and sorted(seen) == list(range(length))
    assert set(seen.values()) == {1}


def test_permutation_depends_on_seed_and_epoch_only():
    assert permutation(100, 7, 0) == permutation(100, 7, 0)
    assert permutation(100, 7, 0) != permutation(100, 7, 1)
    assert permutation(100, 7, 0) != permutation(100, 8, 0)
    assert sorted(permutation(100, 7, 3)) == list(range(100))


def test_plan_rejects_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        DataPlan(0, 0, 4, 1, 0, 1)
    with pytest.raises(ValueError, match="outside a world of 2"):
        DataPlan(10, 0, 4, 2, 2, 1)
    with pytest.raises(ValueError, match="outside an epoch"):
        next(DataPlan(10, 0, 4, 1, 0, 1).steps(0, 11))


@pytest.mark.parametrize(
    ("length", "global_batch", "world", "rank", "micro", "epoch", "cursor"),
    [(23, 7, 3, 1, 2, 1, 7), (23, 7, 3, 2, 3, 0, 0), (5, 4, 4, 3, 2, 2, 4), (9, 9, 2, 0, 1, 0, 9)],
)
def test_plan_sampler_yields_the_plan_from_the_position(length, global_batch, world, rank, micro, epoch, cursor):
    plan = DataPlan(length, 3, global_batch, world, rank, micro)
    sampler = PlanSampler(plan)
    sampler.position(epoch, cursor)
    expected = [list(batch.indices) for step in plan.steps(epoch, cursor) for batch in step.micro]
    assert list(sampler) == expected
    assert len(sampler) == len(expected) == plan.steps_in_epoch(cursor) * micro
    # Through a real DataLoader: the samples arrive in plan order, fillers included.
    loader = DataLoader(TensorDataset(torch.arange(length)), batch_sampler=sampler)
    assert [batch[0].tolist() for batch in loader] == expected


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.e2e)])  # 2: loader processes
def test_the_feed_gives_each_step_the_plan_of_the_batches_it_fetched(workers):
    """The sampler hands each step's plan to the feed as the loader reads its indices (ahead, with workers): every
    step the feed yields holds the plan of exactly its own batches, epoch after epoch, from a cursor, and after a
    pass left early (a loop's break) with plans read ahead."""
    from service.config import DataConfig
    from service.data.feeds import MapFeed

    length, plan = 23, DataPlan(23, 3, 7, 3, 1, 2)
    feed = MapFeed(TensorDataset(torch.arange(length)), plan, DataConfig(num_workers=workers), 0, None)
    left = feed.steps(0, 0)
    assert next(left).plan == next(plan.steps(0, 0))  # then left: the loader has read further ahead
    for epoch, cursor in ((0, 0), (1, 7), (2, 0)):
        fed = list(feed.steps(epoch, cursor))
        assert [f.plan for f in fed] == list(plan.steps(epoch, cursor))
        for step in fed:
            assert [batch[0].tolist() for batch in step.batches] == [list(b.indices) for b in step.plan.micro]


# --------------------------------------------------------------------------------------------------
# 2. Checkpoint files: damage falls back to the previous valid checkpoint, with a warning
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def two_checkpoints(tmp_path):
    directory = tmp_path / "checkpoints"
    write_checkpoint(directory, 1, make_state(1.0), HASH)
    write_checkpoint(directory, 2, make_state(2.0), HASH)
    assert newest(directory)[0] == 2
    return directory


def _truncate(d):
    path = d / state_name(2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(d):
    (d / state_name(2)).write_bytes(b"")


def _flip(d):
    path = d / state_name(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _no_manifest(d):
    (d / manifest_name(2)).unlink()


def _no_state(d):
    (d / state_name(2)).unlink()


def _manifest_not_json(d):
    (d / manifest_name(2)).write_text('{"step": 2, "file": "step-00000002.pt", ')


def _manifest_binary(d):
    (d / manifest_name(2)).write_bytes(b"\xff\xfe\x00\x80 garbage")


def _manifest_wrong_step(d):
    shutil.copy(d / manifest_name(1), d / manifest_name(2))


def _manifest_bad_field(d):
    data = json.loads((d / manifest_name(2)).read_text())
    (d / manifest_name(2)).write_text(json.dumps({**data, "sha256": "not-a-digest"}))


def _manifest_deeply_nested(d):
    (d / manifest_name(2)).write_bytes(b"[" * 5000)  # within the 64 KiB limit


def _grown(d):
    with open(d / state_name(2), "ab") as file:
        file.write(b"more")


def _link_outside(d):
    """A byte-identical copy outside checkpoints/: valid size and sha256, but a link leaving the directory."""
    outside = d.parent / "elsewhere.pt"
    (d / state_name(2)).rename(outside)
    (d / state_name(2)).symlink_to(outside)


def _manifest_is_a_directory(d):
    (d / manifest_name(2)).unlink()
    (d / manifest_name(2)).mkdir()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "truncated"),
        (_empty, "truncated"),
        (_flip, "sha256"),
        (_no_manifest, "no manifest"),
        (_no_state, "is missing"),
        (_manifest_not_json, "not valid"),
        (_manifest_binary, "not valid"),
        (_manifest_wrong_step, "names step 1"),
        (_manifest_bad_field, "not valid"),
        pytest.param(_manifest_deeply_nested, "not valid"),
        (_grown, "written to since"),
        (_link_outside, "is a symbolic link to"),
        (_manifest_is_a_directory, "step-00000002.json is a directory, not a regular file"),
    ],
    ids=lambda value: value.__name__.strip("_") if callable(value) else None,
)
def test_damaged_newest_falls_back_to_previous(two_checkpoints, caplog, damage, reason):
    damage(two_checkpoints)
    with caplog.at_level(logging.WARNING, logger=IO_LOG):
        step, state = newest(two_checkpoints)
    assert step == 1 and state["model"]["w"].tolist() == [1.0] * 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(two_checkpoints / state_name(2)) in m and reason in m for m in warnings), warnings


_CRASH_BEFORE_RENAME = """
import os, sys
from pathlib import Path
import torch
from service.state import checkpoint_io
checkpoint_io.os.replace = lambda *args: os._exit(9)  # the process dies between write and rename
checkpoint_io.write_checkpoint(Path(sys.argv[1]), 3, {"format": 1, "model": {"w": torch.ones(4)}}, "0" * 64)
"""


def crash_before_rename(directory: Path) -> None:
    """Really run a save of step 3 in another process that dies right before its first rename."""
    done = subprocess.run([sys.executable, "-c", _CRASH_BEFORE_RENAME, str(directory)], env=child_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 9, done.stderr[-3000:]


@pytest.mark.e2e
def test_crash_before_rename_leaves_previous_checkpoint(two_checkpoints, caplog):
    crash_before_rename(two_checkpoints)
    leftovers = sorted(two_checkpoints.glob(".step-00000003.*.tmp"))
    assert [p.name.split(".")[2] for p in leftovers] == ["json", "pt"]  # both written and fsynced, not renamed
    assert not (two_checkpoints / state_name(3)).exists() and not (two_checkpoints / manifest_name(3)).exists()
    with caplog.at_level(logging.WARNING, logger=IO_LOG):
        step, state = newest(two_checkpoints)
    assert step == 2 and state["model"]["w"].tolist() == [2.0] * 4


class _Crash(BaseException):
    """Not an OSError: write_checkpoint's cleanup does not run, as after a SIGKILL."""


def test_crash_between_the_two_renames_falls_back_with_a_warning(two_checkpoints, monkeypatch, caplog):
    real_replace, calls = os.replace, []

    def replace_then_die(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:
            raise _Crash
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_io.os, "replace", replace_then_die)
    with pytest.raises(_Crash):
        write_checkpoint(two_checkpoints, 3, make_state(3.0), HASH)
    monkeypatch.undo()
    assert calls == [state_name(3), manifest_name(3)]  # the state goes first, the manifest makes it count
    assert (two_checkpoints / state_name(3)).exists() and not (two_checkpoints / manifest_name(3)).exists()
    with caplog.at_level(logging.WARNING, logger=IO_LOG):
        assert newest(two_checkpoints)[0] == 2
    assert any(str(two_checkpoints / state_name(3)) in r.getMessage() and "no manifest" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_symlink_inside_the_checkpoint_directory_is_followed(two_checkpoints):
    (two_checkpoints / state_name(2)).rename(two_checkpoints / "kept.pt")
    (two_checkpoints / state_name(2)).symlink_to("kept.pt")
    step, state = newest(two_checkpoints)
    assert step == 2 and state["model"]["w"].tolist() == [2.0] * 4


_SCAN = """
import logging, sys
from pathlib import Path
from service.state.checkpoint_io import scan
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
manifest, payload = next(scan(Path(sys.argv[1])))
print("newest", manifest.step, len(payload))
"""


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link_to_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _sparse_terabyte(path: Path) -> None:
    os.truncate(path, 2**40)  # no disk used; reading it in full asks for 1 TiB of memory


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("plant", "name", "reason"),
    [
        (_fifo, state_name(2), "step-00000002.pt is a FIFO (named pipe), not a regular file"),
        (_fifo, manifest_name(2), "step-00000002.json is a FIFO (named pipe), not a regular file"),
        (_link_to_dev_zero, state_name(2), "step-00000002.pt is a symbolic link to /dev/zero, outside"),
        (_link_to_dev_zero, manifest_name(2), "step-00000002.json is a symbolic link to /dev/zero, outside"),
        (_sparse_terabyte, state_name(2), f"step-00000002.pt has {2**40} bytes, its manifest says"),
    ],
    ids=["fifo-state", "fifo-manifest", "dev-zero-state", "dev-zero-manifest", "sparse-1tib-state"],
)
def test_planted_files_are_skipped_before_a_byte_is_read(two_checkpoints, plant, name, reason):
    """Issue 15: a FIFO hung the scan, /dev/zero filled memory. A real process, under a timeout and 2 GiB."""
    plant(two_checkpoints / name)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # torch itself maps about 0.7 GiB

    done = subprocess.run([sys.executable, "-c", _SCAN, str(two_checkpoints)], env=child_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60, preexec_fn=cap)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["newest", "1", str((two_checkpoints / state_name(1)).stat().st_size)]
    assert f"WARNING skipping checkpoint {two_checkpoints / state_name(2)}: {reason}" in done.stderr, done.stderr


def test_saving_a_step_again_replaces_it(two_checkpoints):
    before = (two_checkpoints / state_name(2)).read_bytes()
    manifest = write_checkpoint(two_checkpoints, 2, make_state(22.0), HASH)
    after = (two_checkpoints / state_name(2)).read_bytes()
    assert after != before and manifest.sha256 == hashlib.sha256(after).hexdigest()
    step, state = newest(two_checkpoints)
    assert step == 2 and state["model"]["w"].tolist() == [22.0] * 4
    assert files(two_checkpoints) == [manifest_name(1), state_name(1), manifest_name(2), state_name(2)]


_REMOVALS: list[str] | None = None


def _record_removals(event: str, args: tuple) -> None:
    if _REMOVALS is not None and event == "os.remove":
        _REMOVALS.append(Path(os.fsdecode(args[0])).name)


sys.addaudithook(_record_removals)  # observes os.unlink; changes nothing


def test_prune_keeps_the_newest_and_drops_manifest_before_state(tmp_path):
    global _REMOVALS
    directory = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        write_checkpoint(directory, step, make_state(step), HASH)
    _REMOVALS = []
    try:
        prune(directory, 3, 5)
    finally:
        removed, _REMOVALS = _REMOVALS, None
    assert files(directory) == sorted(f"step-{s:08d}.{e}" for s in (3, 4, 5) for e in ("pt", "json"))
    for step in (1, 2):
        assert removed.index(manifest_name(step)) < removed.index(state_name(step)), removed
    assert sorted(removed) == sorted([manifest_name(1), state_name(1), manifest_name(2), state_name(2)])
    for step in (3, 4, 5):
        read_verified(directory, step)


def test_prune_waits_for_enough_complete_checkpoints(tmp_path):
    directory = tmp_path / "checkpoints"
    write_checkpoint(directory, 1, make_state(1.0), HASH)
    write_checkpoint(directory, 2, make_state(2.0), HASH)
    (directory / manifest_name(2)).unlink()  # step 2 incomplete: pruning down to step 1 alone would be unsafe
    prune(directory, 2, 2)
    assert files(directory) == [manifest_name(1), state_name(1), state_name(2)]


@pytest.mark.e2e
def test_prune_removes_leftovers_of_a_crashed_save(two_checkpoints):
    crash_before_rename(two_checkpoints)
    assert len(list(two_checkpoints.glob(".step-*.tmp"))) == 2
    write_checkpoint(two_checkpoints, 3, make_state(3.0), HASH)  # this process saves step 3 properly
    prune(two_checkpoints, 2, 3)
    assert files(two_checkpoints) == [manifest_name(2), state_name(2), manifest_name(3), state_name(3)]


def test_checkpointer_keeps_exactly_keep(tmp_path):
    saver = Rank0Checkpointer(tmp_path, every_steps=2, keep=2, config_hash=HASH, on_error="stop",
                              async_save=False)  # fmt: skip
    calls = []

    def state():
        calls.append(1)
        return make_state(len(calls))

    for step in range(1, 8):
        saver.maybe_save(step, state)
    saver.save(6, state)  # this process wrote step 6 already: not again
    saver.close()
    assert files(tmp_path) == [manifest_name(4), state_name(4), manifest_name(6), state_name(6)]
    assert len(calls) == 3 and saver.last_path == tmp_path / state_name(6) and saver.failures == 0


# --------------------------------------------------------------------------------------------------
# 3. A malicious pickle is refused, not run
# --------------------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.e2e
def test_malicious_checkpoint_is_refused_without_running(tmp_path):
    directory, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    directory.mkdir()
    buffer = io.BytesIO()
    torch.save({**make_state(1.0), "model": _Evil(f"touch {marker}")}, buffer)
    payload = buffer.getvalue()
    (directory / state_name(7)).write_bytes(payload)
    manifest = Manifest(
        step=7, file=state_name(7), size=len(payload), sha256=hashlib.sha256(payload).hexdigest(),
        config_hash=HASH, torch=str(torch.__version__), service="0.1.0", created=time.time(),
    )  # fmt: skip
    (directory / manifest_name(7)).write_text(manifest.model_dump_json())

    checked, raw = read_verified(directory, 7)  # size and sha256 match: it is a "valid" checkpoint
    assert checked.step == 7 and raw == payload
    source = str(directory / state_name(7))
    with pytest.raises(UnsafeCheckpointError) as info:
        load_state(raw, source)
    message = str(info.value)
    assert source in message and "Nothing in it was executed" in message
    assert not marker.exists()

    # The payload is real: an unsafe load would have run it.
    proof = tmp_path / "proof"
    buffer = io.BytesIO()
    torch.save({"x": _Evil(f"touch {proof}")}, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)
    assert proof.exists()


def test_load_state_refuses_foreign_files(tmp_path):
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "model": {}}, buffer)  # loadable, but missing keys
    with pytest.raises(ValueError, match="not a ddp-service checkpoint"):
        load_state(buffer.getvalue(), "x.pt")
    with pytest.raises(ValueError, match="y.pt is not a readable torch checkpoint"):
        load_state(buffer.getvalue()[:-100], "y.pt")  # a cut-off zip archive


# --------------------------------------------------------------------------------------------------
# 4. A full disk: the save fails cleanly, the previous checkpoint stays
# --------------------------------------------------------------------------------------------------


def full_disk(small_fs, kind: str) -> tuple[Path, callable]:
    """(checkpoint directory, make-it-full) on a fresh tmpfs that has room for exactly one small checkpoint.

    ``bytes``: a ballast file leaves ~20 KB, then a bigger state does not fit (ENOSPC inside torch.save).
    ``inodes``: the tmpfs has 4 inodes (root, directory, state, manifest): the next file cannot be created.
    """
    root = small_fs(inodes=4 if kind == "inodes" else None)
    directory = root / "checkpoints"
    return directory, (lambda: fill(root, 20 * 1024)) if kind == "bytes" else (lambda: None)


# "bytes" fills the disk inside torch.save, whose zip writer turns the OSError into a RuntimeError:
# the checkpoint writer must still report the disk, not torch's "unexpected pos".
FULLNESS = ["bytes", "inodes"]
BIG = 50_000  # 200 KB of float32: more than the ~20 KB left


@pytest.mark.parametrize("kind", FULLNESS)
def test_disk_full_stops_with_a_clear_error(small_fs, kind):
    directory, make_full = full_disk(small_fs, kind)
    saver = Rank0Checkpointer(directory, every_steps=1, keep=2, config_hash=HASH, on_error="stop",
                              async_save=False)  # fmt: skip
    saver.save(1, lambda: make_state(1.0))
    make_full()
    with pytest.raises(CheckpointWriteError) as info:
        saver.save(2, lambda: make_state(2.0, size=BIG))
    saver.close()
    message = str(info.value)
    assert str(directory / state_name(2)) in message and "MiB free" in message and "ENOSPC" in message
    assert not list(directory.glob("*.tmp")) and not list(directory.glob(".*.tmp"))
    assert not (directory / manifest_name(2)).exists()
    assert newest(directory)[0] == 1
    assert saver.failures == 1 and saver.last_path == directory / state_name(1)


@pytest.mark.parametrize("kind", FULLNESS)
def test_disk_full_with_on_error_continue_goes_on(small_fs, kind, caplog):
    directory, make_full = full_disk(small_fs, kind)
    saver = Rank0Checkpointer(directory, every_steps=1, keep=2, config_hash=HASH, on_error="continue",
                              async_save=False)  # fmt: skip
    saver.maybe_save(1, lambda: make_state(1.0))
    make_full()
    with caplog.at_level(logging.INFO, logger="service"):
        saver.maybe_save(2, lambda: make_state(2.0, size=BIG))  # returns
    saver.close()
    assert saver.failures == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(str(directory / state_name(2)) in m and "MiB free" in m and "Training goes on" in m
               for m in errors), errors  # fmt: skip
    assert not list(directory.glob(".*.tmp")) and not (directory / manifest_name(2)).exists()
    assert newest(directory)[0] == 1


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_failed_background_save_is_reported_at_the_next_step(small_fs, on_error, caplog):
    directory, _ = full_disk(small_fs, "inodes")
    saver = Rank0Checkpointer(directory, every_steps=2, keep=2, config_hash=HASH, on_error=on_error,
                              async_save=True)  # fmt: skip
    saver.maybe_save(1, lambda: make_state(1.0))
    saver.maybe_save(2, lambda: make_state(2.0))  # written in the background: fits
    saver.maybe_save(3, lambda: make_state(3.0))
    saver.maybe_save(4, lambda: make_state(4.0))  # the background write fails: no inode left
    saver.close()  # waits for it; the failure is reported by the next maybe_save
    assert saver.failures == 1
    with caplog.at_level(logging.INFO, logger="service"):
        if on_error == "stop":
            with pytest.raises(CheckpointWriteError, match=str(directory / state_name(4))):
                saver.maybe_save(5, lambda: make_state(5.0))
        else:
            saver.maybe_save(5, lambda: make_state(5.0))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("background save of step 4 failed" in m for m in errors), errors
    assert not (directory / manifest_name(4)).exists() and not list(directory.glob(".*.tmp"))
    assert newest(directory)[0] == 2
    saver.maybe_save(7, lambda: make_state(7.0))  # reported once, not again


class _Slow:
    """Pickles slowly (in the writer thread) and records how many writes overlap; loads as an empty OrderedDict."""

    active = 0
    most = 0
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.most = max(cls.most, cls.active)
        started = time.perf_counter()
        time.sleep(self.seconds)
        with cls.lock:
            cls.active -= 1
            cls.spans.append((started, time.perf_counter()))
        return (collections.OrderedDict, ())

    @classmethod
    def reset(cls) -> None:
        cls.active, cls.most, cls.spans = 0, 0, []


def test_background_failure_still_in_flight_at_the_next_save_is_not_lost(small_fs):
    _Slow.reset()
    root = small_fs(inodes=5)  # root, directory, one checkpoint (2) and one more file: the manifest's tmp fails
    directory = root / "checkpoints"
    saver = Rank0Checkpointer(directory, every_steps=1, keep=2, config_hash=HASH, on_error="stop",
                              async_save=True)  # fmt: skip
    try:
        saver.maybe_save(1, lambda: make_state(1.0))
        saver.maybe_save(2, lambda: {**make_state(2.0), "slow": _Slow(0.5)})  # fails after 0.5 s
        with pytest.raises(CheckpointWriteError, match=state_name(2)):
            saver.maybe_save(3, lambda: make_state(3.0))  # a save step: the failure of step 2 must surface
    finally:
        saver.close()


# --------------------------------------------------------------------------------------------------
# 5. Async saves: a real staging copy, one save in flight
# --------------------------------------------------------------------------------------------------


def test_async_save_writes_the_staged_values_one_at_a_time(tmp_path):
    _Slow.reset()
    live = torch.arange(6, dtype=torch.float32)
    saver = Rank0Checkpointer(tmp_path, every_steps=1, keep=3, config_hash=HASH, on_error="stop",
                              async_save=True)  # fmt: skip

    def state():
        return {**make_state(0.0), "model": {"w": live}, "slow": _Slow(0.4)}

    saver.maybe_save(1, state)
    returned_1 = time.perf_counter()  # staged and handed off, not written yet
    live.add_(100)  # training goes on and changes the weights in place
    saver.maybe_save(2, state)
    returned_2 = time.perf_counter()
    live.add_(100)
    saver.close()
    assert _Slow.most == 1 and len(_Slow.spans) == 2
    (start_1, end_1), (start_2, _) = sorted(_Slow.spans)
    assert returned_1 < end_1  # maybe_save did not wait for its own write
    assert end_1 <= returned_2 and end_1 <= start_2  # the second save waited for the first
    for step, offset in ((1, 0), (2, 100)):
        _, payload = read_verified(tmp_path, step)
        saved = load_state(payload, state_name(step))
        assert saved["model"]["w"].tolist() == (torch.arange(6.0) + offset).tolist(), step
    assert live.tolist() == (torch.arange(6.0) + 200).tolist()
    assert saver.failures == 0 and saver.last_path == tmp_path / state_name(2)


# --------------------------------------------------------------------------------------------------
# 6. Config and geometry
# --------------------------------------------------------------------------------------------------


def test_keep_must_be_at_least_two():
    with pytest.raises(ConfigError, match="at least 2") as info:
        load_config(None, ["checkpoint.keep=1"])
    assert "checkpoint.keep" in str(info.value)
    assert load_config(None, ["checkpoint.keep=2"]).checkpoint.keep == 2


def test_global_batch_size_excludes_grad_accum():
    with pytest.raises(ConfigError, match="grad_accum") as info:
        load_config(None, ["train.global_batch_size=64", "train.grad_accum=2"])
    assert "global_batch_size" in str(info.value)
    assert load_config(None, ["train.global_batch_size=64"]).train.global_batch_size == 64


def test_batch_geometry():
    assert batch_geometry(TrainConfig(batch_size=4, grad_accum=3), 2) == (24, 3)
    assert batch_geometry(TrainConfig(batch_size=4, global_batch_size=48), 3) == (48, 4)
    assert batch_geometry(TrainConfig(batch_size=4, global_batch_size=48), 4) == (48, 3)
    with pytest.raises(ValueError) as info:
        batch_geometry(TrainConfig(batch_size=4, global_batch_size=30), 3)
    message = str(info.value)
    assert "global_batch_size=30" in message and "world_size 3" in message and "batch_size 4" in message


@settings(max_examples=150, deadline=None, database=None)
@given(
    length=st.integers(1, 200),
    global_batch=st.integers(1, 40),
    epochs=st.integers(1, 3),
    max_steps=st.none() | st.integers(1, 60),
    worlds=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    micro=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    done=st.integers(0, 200),
    at_epoch_end=st.booleans(),
)
def test_total_steps_survive_a_resume_at_a_fixed_global_batch(length, global_batch, epochs, max_steps, worlds,
                                                              micro, done, at_epoch_end):  # fmt: skip
    train = TrainConfig(epochs=epochs, max_steps=max_steps, global_batch_size=global_batch, batch_size=1)
    before = DataPlan(length, 0, global_batch, worlds[0], 0, micro[0])
    after = DataPlan(length, 0, global_batch, worlds[1], worlds[1] - 1, micro[1])
    fresh = plan_total_steps(before, LoopState(), train)
    per_epoch = math.ceil(length / global_batch)
    assert fresh == min(epochs * per_epoch, max_steps or 10**9)
    done = min(done, fresh)
    epoch, in_epoch = divmod(done, per_epoch)
    cursor = min(in_epoch * global_batch, length)
    if at_epoch_end and in_epoch == 0 and epoch > 0:
        epoch, cursor = epoch - 1, length  # saved at the last step of an epoch, before the epoch advanced
    state = LoopState(epoch=epoch, global_step=done, samples_seen=0, epochs_completed=epoch, cursor=cursor)
    assert plan_total_steps(after, state, train) == fresh


def _saved(**train) -> dict:
    return JobConfig(train=TrainConfig(**train)).model_dump(mode="json")


def test_incompatible_fields_name_training_changes_only():
    base = _saved(max_steps=100)
    same = JobConfig(train=TrainConfig(max_steps=100))
    assert incompatible_fields(base, same) == []
    tolerated = JobConfig.model_validate({
        "run_dir": "elsewhere",
        "metrics": {"port": 9100, "tensorboard": False},
        "train": {"max_steps": 200, "log_every": 1, "progress_bar": False},
        "checkpoint": {"every_steps": 7, "keep": 5, "async": True, "on_error": "continue"},
        "data": {"num_workers": 2},
    })  # fmt: skip
    assert incompatible_fields(base, tolerated) == []
    assert config_hash(base) == config_hash(tolerated)

    changed = incompatible_fields(base, JobConfig(train=TrainConfig(max_steps=100, lr=0.2)))
    assert len(changed) == 1 and changed[0].startswith("train.lr (0.05 -> 0.2)")
    changed = incompatible_fields(base, JobConfig(seed=3, train=TrainConfig(max_steps=100, batch_size=4)))
    assert [c.split(" ")[0] for c in changed] == ["seed", "train.batch_size"]

    down = incompatible_fields(base, JobConfig(train=TrainConfig(max_steps=50)))
    assert len(down) == 1 and "train.max_steps (100 -> 50" in down[0] and "only go up" in down[0]
    assert incompatible_fields(_saved(), JobConfig(train=TrainConfig(max_steps=50)))  # unlimited -> 50 is down
    assert incompatible_fields(base, JobConfig()) == []  # 100 -> unlimited is up


def test_fixed_global_batch_lets_the_split_follow_the_world():
    saved = _saved(global_batch_size=64, batch_size=8)
    assert incompatible_fields(saved, JobConfig(train=TrainConfig(global_batch_size=64, batch_size=4))) == []
    changed = incompatible_fields(saved, JobConfig(train=TrainConfig(global_batch_size=32, batch_size=8)))
    assert [c.split(" ")[0] for c in changed] == ["train.global_batch_size"]


# --------------------------------------------------------------------------------------------------
# 7. checkpoint.resume=never moves earlier checkpoints aside
# --------------------------------------------------------------------------------------------------


def test_archive_existing_moves_checkpoints_aside(two_checkpoints, caplog):
    originals = {path.name: path.read_bytes() for path in two_checkpoints.iterdir()}
    with caplog.at_level(logging.WARNING, logger="service.state.checkpoint"):
        first = archive_existing(two_checkpoints)
    assert first is not None and first.parent == two_checkpoints.parent
    assert first.name.startswith("checkpoints.before-")
    assert not two_checkpoints.exists()
    assert {path.name: path.read_bytes() for path in first.iterdir()} == originals
    assert any(str(first) in r.getMessage() for r in caplog.records)
    assert archive_existing(two_checkpoints) is None  # nothing there: nothing to move

    # A fresh run saves into an empty directory; a second fresh start in the same second moves it aside too.
    saver = Rank0Checkpointer(two_checkpoints, every_steps=1, keep=2, config_hash=HASH, on_error="stop",
                              async_save=False)  # fmt: skip
    saver.save(1, lambda: make_state(10.0))
    second_saver = Rank0Checkpointer(two_checkpoints, every_steps=1, keep=2, config_hash=HASH, on_error="stop",
                                     async_save=False, start_fresh=True)  # fmt: skip
    archived = sorted(two_checkpoints.parent.glob("checkpoints.before-*"))
    assert len(archived) == 2 and first in archived
    assert {path.name: path.read_bytes() for path in first.iterdir()} == originals
    second = next(path for path in archived if path != first)
    assert newest(second)[1]["model"]["w"].tolist() == [10.0] * 4
    assert not two_checkpoints.exists() or not list(two_checkpoints.iterdir())
    second_saver.save(1, lambda: make_state(11.0))
    assert newest(two_checkpoints)[1]["model"]["w"].tolist() == [11.0] * 4


# --------------------------------------------------------------------------------------------------
# Preemption: a real signal sets the flag; the agreement read one boundary later stops every rank together
# --------------------------------------------------------------------------------------------------


def test_preemption_checks_about_every_interval_and_stops_at_the_agreed_step():
    import signal

    from service.state.preemption import Preemption

    now = [0.0]
    calls: list[tuple[int, int]] = []

    def agree(local: int, proposal: int):  # noqa: ANN202 - starts the check; the call it returns reads it
        calls.append((local, proposal))
        return lambda: reads.append(len(calls)) or (local, min(proposal, 7))  # another rank proposes 7 steps

    reads: list[int] = []  # which check each read was
    before = signal.getsignal(signal.SIGUSR1)
    watch = Preemption(agree, interval=0.1, clock=lambda: now[0])
    try:
        now[0] += 0.01  # a 10 ms step
        assert watch.stop_now() is None and calls == [(0, 10)]  # 10 steps cover 0.1 s; the ranks agree on 7
        assert reads == [1]  # read at once: the agreed interval was one step
        for _ in range(6):
            now[0] += 0.01
            assert watch.stop_now() is None
        assert len(calls) == 1  # no collective between checks
        now[0] += 0.01
        assert watch.stop_now() is None and calls[-1] == (0, 10) and reads == [1]  # 7 steps on: started, not read
        now[0] += 0.01
        assert watch.stop_now() is None and reads == [1, 2]  # read one step later: it ran during that step
        for _ in range(5):
            now[0] += 0.01
            assert watch.stop_now() is None
        assert len(calls) == 2  # the next starts 7 steps after the last one started
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, handled between bytecodes
        assert watch.requested and watch.received == "SIGUSR1"
        now[0] += 0.5  # a slow step: 7 steps took 0.56 s since the last check, 80 ms each, so 2 steps now
        assert watch.stop_now() is None and calls[-1] == (1, 2)
        now[0] += 0.08
        assert watch.stop_now() == "preempted" and reads == [1, 2, 3]  # every rank stops one step later
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.e2e
def test_loader_workers_signalled_as_they_start_live_on_and_the_trainer_keeps_its_signal(monkeypatch):
    """Issue 15, finding 3, in real DataLoader processes: SIGTERM reaches each worker right after torch has put its
    worker handlers in, before ``worker_init_fn`` ignores it; the workers are born with it blocked, so they live.
    The trainer's own signal while it starts workers is kept, not lost."""
    import signal

    from torch.utils.data._utils import signal_handling

    from service.config import DataConfig
    from service.data.loaders import eval_loader
    from service.state.preemption import Preemption, held_back
    from service.world.env import WorldInfo

    installed = signal_handling._set_worker_signal_handlers

    def install_then_signal(*args: object) -> None:
        installed(*args)
        os.kill(os.getpid(), signal.SIGTERM)  # this worker, in the moment before its worker_init_fn

    monkeypatch.setattr(signal_handling, "_set_worker_signal_handlers", install_then_signal)
    dataset = TensorDataset(torch.arange(12.0).unsqueeze(1), torch.zeros(12))
    loader = eval_loader(dataset, 4, DataConfig(num_workers=2), WorldInfo(launcher="none"))
    watch = Preemption()
    try:
        for _ in range(2):  # the eval loader starts fresh workers at every pass
            assert [inputs.squeeze(1).tolist() for inputs, _ in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert watch.received is None  # the workers' signals stayed theirs
        with held_back():
            os.kill(os.getpid(), signal.SIGTERM)
        # Held back in this thread, the signal may go to another thread of the process (gRPC's, in a pytest worker
        # that ran the rendezvous tests): its handler then runs in this thread at a later bytecode, not at once.
        deadline = time.monotonic() + 5
        while watch.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.received == "SIGTERM"
    finally:
        watch.close()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # nothing left blocked here


def test_stop_here_agrees_at_once_and_the_agreement_is_local_until_connected():
    from service.state.preemption import Preemption

    calls: list[tuple[int, int]] = []

    def agree(local: int, proposal: int):  # noqa: ANN202 - starts the check; the call it returns reads it
        calls.append((local, proposal))
        return lambda: (local, 50)

    now = [0.0]
    watch = Preemption(interval=0.1, clock=lambda: now[0])
    try:
        now[0] += 0.5  # start-up took 0.5 s
        assert watch.stop_here() is None  # before the process group: its own flag, no collective
        watch.connect(agree)
        now[0] += 0.01
        assert watch.stop_now() is None and len(calls) == 1  # the ranks agree on 50 steps to the next check
        assert watch.stop_now() is None and len(calls) == 1
        watch.received = "SIGTERM"  # as the handler sets it, e.g. during an evaluation
        assert watch.stop_here() == "preempted" and calls[-1][0] == 1  # at once, not 48 steps later
    finally:
        watch.close()


def proposing_watch(interval: float) -> tuple[Preemption, list[float], list[int]]:
    """A ``Preemption`` on a clock the test moves (``now[0]``), whose checks agree at once on what it proposed
    (each proposal recorded in ``proposals``)."""
    now: list[float] = [0.0]
    proposals: list[int] = []

    def agree(local: int, proposal: int):  # noqa: ANN202 - starts the check; the call it returns reads it
        proposals.append(proposal)
        return lambda: (local, proposal)

    return Preemption(agree, interval=interval, clock=lambda: now[0], signals=()), now, proposals


def test_a_check_soon_after_another_times_the_steps_between_them_not_the_agreed_interval():
    """An evaluation's check 3 steps after a check that agreed on 10 steps of 10 ms: it proposes 10 again. Timed
    over the 10 agreed steps instead, the 3 steps looked 3 ms each and it proposed 34, so a short run's last 30 steps
    had no check and a SIGTERM in them let the job complete instead of stopping (the TBPTT session test, now and
    then: eval at each epoch's end, about 60 steps in all)."""
    watch, now, proposals = proposing_watch(interval=0.1)
    try:
        now[0] += 0.01
        assert watch.stop_now() is None and proposals == [10]
        for _ in range(3):
            now[0] += 0.01
            assert watch.stop_now() is None
        assert watch.stop_here() is None and proposals == [10, 10]
        now[0] += 0.3  # an evaluation right after it: timed as one step, so the next check comes at once
        assert watch.stop_here() is None and proposals[-1] == 1
    finally:
        watch.close()


def test_a_quick_evaluation_after_a_check_does_not_put_the_next_check_steps_away():
    """Steps of 0.3 s check at every boundary; an evaluation of 5 ms right after a check used to be timed as a step
    of 5 ms, so it proposed 20 steps to the next check, and a SIGTERM during those (a world of one in the resize
    test, now and then) let the run complete instead of stopping at the next boundary."""
    watch, now, proposals = proposing_watch(interval=0.1)
    try:
        now[0] += 0.3
        assert watch.stop_now() is None and proposals == [1]
        now[0] += 0.005  # a quick evaluation
        assert watch.stop_here() is None and proposals[-1] == 1
        watch.received = "SIGTERM"
        now[0] += 0.3
        assert watch.stop_now() == "preempted"
    finally:
        watch.close()


def test_a_check_in_flight_is_read_before_stop_heres_own_and_by_settle():
    """A check that short steps left in flight is read, in the order started, before an evaluation's agreement (which
    waits at once) and at the run's end; its stop wins there, on every rank alike."""
    from service.state.preemption import Preemption

    log: list[str] = []

    def agree(local: int, proposal: int):  # noqa: ANN202 - starts the check; the call it returns reads it
        log.append(f"start {local}")
        return lambda: log.append(f"read {local}") or (local, 5)

    now = [0.0]
    watch = Preemption(agree, interval=0.1, clock=lambda: now[0], signals=())
    try:
        assert watch.stop_here() is None and log == ["start 0", "read 0"]
        for _ in range(5):
            now[0] += 0.01
            assert watch.stop_now() is None
        assert log[-1] == "start 0"  # in flight
        assert watch.stop_here() is None and log[-3:] == ["read 0", "start 0", "read 0"]
        for _ in range(5):
            assert watch.stop_now() is None
        watch.received = "SIGTERM"  # came during the step the check runs in: the next check carries it
        assert log[-1] == "start 0" and watch.stop_here() == "preempted" and log[-1] == "read 1"
        for _ in range(5):
            assert watch.stop_now() is None
        watch.settle()
        assert log[-2:] == ["start 1", "read 1"]
        watch.settle()  # nothing in flight: nothing to read
        assert log[-1] == "read 1"
    finally:
        watch.close()


def test_a_never_job_finds_only_its_own_lineage_and_reads_no_other(tmp_path):
    """``resume=never``: the lineage is one per run id, so a restart finds what its job wrote; another run's
    checkpoints are passed over on their manifest, before a byte of their state is read."""
    from service.state.resume import job_lineage

    own = job_lineage("run-1")
    assert own == job_lineage("run-1") != job_lineage("run-2") and job_lineage(None) is None
    directory = tmp_path / "checkpoints"
    checkpoint_io.write_checkpoint(directory, 4, make_state(4.0), HASH, lineage=own)
    checkpoint_io.write_checkpoint(directory, 8, make_state(8.0), HASH, lineage="another-run")
    (directory / "step-00000008.pt").write_bytes(b"broken")  # would be reported if it were read
    assert [manifest.step for manifest, _ in checkpoint_io.scan(directory, {own})] == [4]
    assert [manifest.step for manifest, _ in checkpoint_io.scan(directory)] == [4]  # 8 is skipped as broken
