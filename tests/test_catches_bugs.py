"""Tests aimed at plausible bugs that the rest of the suite let through (issue 10, part 10).

Each test was watched failing once against its bug, introduced alone into a copy of the repository:

- eval shard ignores the rank / eval totals not all-reduced
  → ``test_eval_of_two_ranks_equals_one_rank_on_the_same_weights``
- the epoch never reaches the sampler (``set_epoch`` analogue)  → ``test_each_epoch_feeds_its_own_permutation``
- gradients all-reduced on every micro-step (no ``no_sync``)
  → ``test_gradient_accumulation_all_reduces_once_per_optimizer_step``
- a checkpoint written straight to its final name               → ``test_a_save_killed_mid_write_leaves_no_final_name``
- the HMAC compared on a prefix only
  → ``test_every_flipped_byte_of_a_signed_state_is_refused``
- batches, not samples, reported to Prometheus                   → ``test_prometheus_counts_samples_of_a_running_job``

Real processes throughout: torchrun jobs, a subprocess killed mid-save, an HTTP scrape of the live workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_env, kill_group, read_summary, run_job, torchrun_cmd
from rendezvous.conftest import free_ports

# -- a. evaluation: every sample once, all ranks summed ------------------------------------------

EVAL_JOB = (
    "task=digits-classification", "task_options.batchnorm=false",
    "train.global_batch_size=8", "train.batch_size=4", "train.max_steps=6", "train.epochs=1",
)  # fmt: skip


@pytest.mark.e2e
def test_eval_of_two_ranks_equals_one_rank_on_the_same_weights(tmp_path: Path) -> None:
    """A world of 2 evaluating the very weights a world of 1 evaluated reports the same loss and metric.

    The world of 1 trains 6 steps and saves; a copy of its run dir is then started at world size 2.
    The run is finished, so that start only evaluates again: same weights, eval split over 2 ranks.
    A rank-blind shard (both ranks on the same half) or totals that are not all-reduced change the numbers.
    """
    one = tmp_path / "one"
    run_job(one, 1, *EVAL_JOB, start="alone")
    first = read_summary(one)
    assert first["status"] == "completed" and first["global_step"] == 6, first
    two = tmp_path / "two"
    shutil.copytree(one, two)
    run_job(two, 2, *EVAL_JOB, start="warm")
    second = read_summary(two)
    assert second["world_size"] == 2 and second["resumed_from"] is not None, second
    assert second["global_step"] == 6 and second["model_digest"] == first["model_digest"], second
    assert second["final_loss"] == pytest.approx(first["final_loss"], rel=1e-6, abs=1e-9), (
        f"eval loss on identical weights: world 1 {first['final_loss']!r}, world 2 {second['final_loss']!r}"
    )
    assert second["eval_metric"]["value"] == pytest.approx(first["eval_metric"]["value"], abs=1e-12), (
        f"eval accuracy on identical weights: world 1 {first['eval_metric']}, world 2 {second['eval_metric']}"
    )


# -- b. every epoch its own order -----------------------------------------------------------------


@pytest.mark.e2e
def test_each_epoch_feeds_its_own_permutation(tmp_path: Path) -> None:
    """What the DataLoader really fetched (not what the plan says) is epoch e's permutation, for e = 0, 1, 2."""
    from service.data.sampler import epoch_order

    size, epochs, seed = 24, 3, 5
    record = tmp_path / "record"
    run_job(tmp_path / "run", 1, "task=probe_tasks:recording_shapes", f"task_options.record_dir={record}",
            f"task_options.train_size={size}", "task_options.eval_size=8", "train.batch_size=8",
            f"train.epochs={epochs}", f"seed={seed}", "data.num_workers=0", start="alone")  # fmt: skip
    fetched = [int(line) for line in (record / "fetch-rank0.txt").read_text().split()]
    assert len(fetched) == size * epochs, fetched
    orders = [fetched[e * size : (e + 1) * size] for e in range(epochs)]
    for epoch, order in enumerate(orders):
        assert sorted(order) == list(range(size)), f"epoch {epoch} did not feed every sample once: {order}"
    # The same order twice means the epoch never reached the sampler (DistributedSampler's set_epoch bug).
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2], (
        f"epochs fed the same order: {orders}"
    )
    for epoch, order in enumerate(orders):
        assert order == epoch_order(size, seed, epoch).tolist(), f"epoch {epoch} fed {order}"


# -- c. one gradient all-reduce per optimizer step --------------------------------------------------

_COMM_WORKER = r"""
import json, os, sys

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from service.config import load_config
from service.loop.runtime import Runtime
from service.loop.stepping import steps
from service.loop.train import build_job, optimizer_step
from service.state.preemption import Preemption
from service.world.env import detect_world


def run(config, world):
    with Runtime.opened(config, world, Preemption()) as runtime:
        job = build_job(runtime)
        calls = []

        def counting(state, bucket):
            calls.append([bucket.index(), bool(bucket.is_last())])
            return allreduce_hook(None, bucket)

        job.model.register_comm_hook(None, counting)
        for fed in steps(runtime, job.feed, one_epoch=True):
            optimizer_step(job, fed.plan, fed.batches, runtime.state.global_step + 1)
        return {"calls": calls, "steps": runtime.state.global_step, "micro_steps": job.feed.plan.micro_steps}


out, run_dir, accum = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(run_dir, exist_ok=True)  # the CLI makes run_dir before build_job; so do we
config = load_config(None, [
    f"run_dir={run_dir}", "task=digits-classification", "task_options.batchnorm=false",
    "train.batch_size=4", f"train.grad_accum={accum}", "train.max_steps=3", "train.progress_bar=false",
    "train.log_every=1000", "metrics.tensorboard=false", "checkpoint.every_steps=0", "checkpoint.resume=never",
])
world = detect_world(os.environ)
result = run(config, world)
with open(f"{out}.rank{world.rank}", "w") as file:
    json.dump(result, file)
"""


@pytest.mark.e2e
def test_gradient_accumulation_all_reduces_once_per_optimizer_step(tmp_path: Path) -> None:
    """With grad_accum=4, DDP reduces each bucket once per optimizer step (no_sync on the first 3 micro-steps).
    The script runs under ``ddp-service launch --script`` (workers forked from the fork server: conftest.STARTS),
    the start being no part of this."""
    script = tmp_path / "comm_worker.py"
    script.write_text(_COMM_WORKER)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "service", "launch", "--standalone", "--nproc-per-node=2", "--script", str(script),
           "--", str(out), str(tmp_path / "run"), "4"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:]
    for rank in (0, 1):
        result = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert result["steps"] == 3 and result["micro_steps"] == 4, result
        calls = result["calls"]
        buckets = 1 + max(index for index, _ in calls)
        finished = sum(last for _, last in calls)
        assert finished == result["steps"] and len(calls) == result["steps"] * buckets, (
            f"rank {rank}: {len(calls)} bucket all-reduces ({finished} complete gradient syncs) for "
            f"{result['steps']} optimizer steps of {result['micro_steps']} micro-steps and {buckets} bucket(s); "
            "expected one sync per optimizer step"
        )


# -- d. a save killed mid-write ---------------------------------------------------------------------

_BLOCKING_SAVE = r'''
import sys, time
from pathlib import Path

import torch

from service.state.checkpoint_io import write_checkpoint


class Blocks:
    """Pickling this signals the test, then hangs: the save is in progress when the test kills us."""

    def __reduce__(self):
        Path(sys.argv[2]).write_text("saving")
        time.sleep(600)
        return (int, ())


state = {"format": 1, "model": {"w": torch.full((4096,), 2.0)}, "optimizer": {}, "scheduler": {},
         "loop": {"global_step": 2}, "rng": {}, "config": {}, "stall": Blocks()}
write_checkpoint(Path(sys.argv[1]), 2, state, "0" * 64)
'''


def _state(step: int) -> dict:
    return {"format": 1, "model": {"w": torch.full((4096,), float(step))}, "optimizer": {}, "scheduler": {},
            "loop": {"global_step": step}, "rng": {}, "config": {}}  # fmt: skip


@pytest.mark.e2e
def test_a_save_killed_mid_write_leaves_no_final_name(tmp_path: Path) -> None:
    """SIGKILL during torch.save: the step's final name never appears; the previous checkpoint stays the newest."""
    from service.state.checkpoint_io import load_state, scan, write_checkpoint

    directory = tmp_path / "checkpoints"
    write_checkpoint(directory, 1, _state(1), "0" * 64)
    script, marker = tmp_path / "blocking_save.py", tmp_path / "saving"
    script.write_text(_BLOCKING_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(directory), str(marker)], cwd=REPO, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the saving process exited early: {proc.stdout.read().decode()[-4000:]}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.02)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_group(proc)
        proc.wait(timeout=30)
    names = sorted(path.name for path in directory.iterdir())
    assert "step-00000002.pt" not in names and "step-00000002.json" not in names, (
        f"a save killed mid-write left its final name behind: {names}"
    )
    assert any(name.startswith(".step-00000002.pt.") and name.endswith(".tmp") for name in names), (
        f"the killed save should have left only its temporary file: {names}"
    )
    manifest, payload = next(scan(directory))
    assert manifest.step == 1, f"scan() returns step {manifest.step} after a killed save of step 2: {names}"
    assert load_state(payload, "step 1")["loop"]["global_step"] == 1


# -- e. the HMAC covers every byte ------------------------------------------------------------------


def test_every_flipped_byte_of_a_signed_state_is_refused() -> None:
    """Flip each bit-0 of every byte (header, nonce, all 32 MAC bytes, payload): each is refused."""
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    from service.rendezvous.dynamic.signing import StateCodec, StateIntegrityError

    codec, key = StateCodec(b"a-secret-of-at-least-16-chars"), b"/torchelastic/etcd3/run/state"
    real = _RendezvousState()
    real.round = 7
    state = pickle.dumps(real)  # a state torch itself would store: decode also checks what it unpickles to
    blob = codec.encode(state, key)
    assert codec.decode(blob, key) == state
    accepted = []
    for position in range(len(blob)):
        for mask in (0x01, 0x80):
            tampered = bytearray(blob)
            tampered[position] ^= mask
            try:
                codec.decode(bytes(tampered), key)
            except StateIntegrityError:
                continue
            accepted.append((position, mask))
    assert not accepted, f"tampered states accepted at (byte, xor mask): {accepted[:20]} ({len(accepted)} in all)"
    # A truncated MAC or payload and another key are refused too.
    for cut in (1, 4, len(state)):
        with pytest.raises(StateIntegrityError):
            codec.decode(blob[:-cut], key)
    with pytest.raises(StateIntegrityError):
        codec.decode(blob, b"/torchelastic/etcd3/other/state")


# -- f. Prometheus counts samples, scraped from a running job ----------------------------------------


_SAMPLE = re.compile(r"^(ddp_train_(?:steps|samples)_total)\{[^}]*\} (\S+)$", re.M)


def _scrape(port: int) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    return {name: float(value) for name, value in _SAMPLE.findall(text)}


@pytest.mark.e2e
def test_prometheus_counts_samples_of_a_running_job(tmp_path: Path) -> None:
    """While a 2-rank job runs, each rank's ddp_train_samples_total == ddp_train_steps_total × batch × accum."""
    batch, accum, steps_per_epoch, epochs = 4, 2, 4, 3
    per_rank = batch * accum
    base = free_ports(2)
    cmd = torchrun_cmd(2, f"run_dir={tmp_path / 'run'}", "task=slow_tasks:slow_shapes", "task_options.sleep=0.06",
                       f"task_options.train_size={steps_per_epoch * per_rank * 2}", "task_options.eval_size=8",
                       f"train.batch_size={batch}", f"train.grad_accum={accum}", f"train.epochs={epochs}",
                       f"metrics.port={base}", start="warm")  # fmt: skip
    seen: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    with subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        try:
            deadline = time.monotonic() + 150
            while proc.poll() is None and time.monotonic() < deadline:
                for rank in (0, 1):
                    values = _scrape(base + rank)
                    if not values or not values.get("ddp_train_steps_total"):
                        continue
                    steps, samples = values["ddp_train_steps_total"], values.get("ddp_train_samples_total", -1.0)
                    if samples != steps * per_rank:  # the two counters are bumped one after the other: re-read once
                        time.sleep(0.01)
                        again = _scrape(base + rank) or values
                        steps, samples = again["ddp_train_steps_total"], again.get("ddp_train_samples_total", -1.0)
                    seen[rank].append((steps, samples))
                time.sleep(0.05)
            assert proc.poll() is not None, "the job ran past 150 s"
            output = proc.stdout.read()  # type: ignore[union-attr]
        finally:
            kill_group(proc)
    assert proc.returncode == 0, output[-6000:]
    total = steps_per_epoch * epochs
    for rank, scrapes in seen.items():
        assert len(scrapes) >= 3, f"rank {rank}: only {len(scrapes)} scrapes while the job ran:\n{output[-3000:]}"
        wrong = [(steps, samples) for steps, samples in scrapes if samples != steps * per_rank]
        assert not wrong, (
            f"rank {rank}: ddp_train_samples_total != ddp_train_steps_total x {per_rank} samples per rank and step "
            f"in (steps, samples) scrapes {wrong[:5]}"
        )
        assert all(0 < steps <= total for steps, _ in scrapes), scrapes
    assert read_summary(tmp_path / "run")["samples_seen"] == total * per_rank * 2
