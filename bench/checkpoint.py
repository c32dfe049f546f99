"""Checkpoint saves: the training stall of a synchronous save against an asynchronous one, and resume transfer.

Not a test. One invocation trains a plain model of ``--layers`` Linear(4096,
4096) (fp32, 64 MiB each; with SGD momentum the checkpoint is twice the
parameters) on a tiny batch, and alternates sync and async rounds of
``service.state.checkpoint.Rank0Checkpointer`` after one untimed warm-up round each
(the first async save allocates its staging buffers). Per round:

* sync:  plain steps, then the step that calls ``maybe_save`` with
  ``async_save=False`` (serialize + sha256 + write + fsync in the step);
* async: plain steps, the step that calls ``maybe_save`` with
  ``async_save=True`` (stages into reused CPU buffers), then steps while the
  background write is in flight, then a few steps to settle.

A stall is that step's time minus the median plain step; the slowdown is the
median step time during an in-flight write over the median plain step. Then the
two ways a resuming rank gets the newest checkpoint are timed in 2 gloo
processes on 127.0.0.1: read + verify from disk (``next(scan(dir))``; page
cache evicted first, and warm) against receiving its bytes from rank 0
(``_broadcast_bytes``), each followed by ``load_state``.

Checkpoints go to a temporary directory under ``--dir`` (default: the system
temporary directory, which must be a real disk, not tmpfs), removed at the end.

    python bench/checkpoint.py [--rounds 5] [--layers 2] [--dir /path/on/disk]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.rendezvous.ports import listen_port  # noqa: E402
from service.state.checkpoint import Rank0Checkpointer, StagingBuffer  # noqa: E402
from service.state.checkpoint_io import FORMAT, load_state, scan  # noqa: E402
from service.state.resume import _broadcast_bytes, rng_state  # noqa: E402

CONFIG_HASH = "0" * 64
WIDTH = 4096
BATCH = 4
PLAIN_STEPS = 8  # plain steps before each save
SETTLE_STEPS = 3  # plain steps after an async write finishes, before the next round
MAX_INFLIGHT_STEPS = 2000
RESUME_ROUNDS = 3
RESUME_TIMEOUT_S = 180
MB = 1e6


class Trainer:
    """A stack of Linear(4096, 4096) + ReLU, SGD with momentum, a step LR schedule; one step is tiny in compute."""

    def __init__(self, layers: int) -> None:
        torch.manual_seed(0)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*blocks)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1000)
        self.inputs = torch.randn(BATCH, WIDTH)
        self.global_step = 0
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model(self.inputs).square().mean().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1

    def state(self) -> dict[str, Any]:
        """What ``service.loop.train.checkpoint_state`` returns, for this model: loadable by ``load_state``."""
        return {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loop": {"epoch": 0, "global_step": self.global_step, "cursor": 0, "samples_seen": 0},
            "rng": rng_state(),
            "config": {"bench": "checkpoint", "layers": len(self.model) // 2},
        }


def timed_step(trainer: Trainer) -> float:
    started = time.perf_counter()
    trainer.step()
    return time.perf_counter() - started


def save_step(trainer: Trainer, ckpt: Rank0Checkpointer) -> tuple[float, float]:
    """A step with ``maybe_save`` at its end, as in ``service.loop.train.train_epoch``; (step, maybe_save) seconds."""
    started = time.perf_counter()
    trainer.step()
    saving = time.perf_counter()
    ckpt.maybe_save(trainer.global_step, trainer.state)
    done = time.perf_counter()
    return done - started, done - saving


def sync_round(trainer: Trainer, ckpt: Rank0Checkpointer) -> dict[str, Any]:
    plain = [timed_step(trainer) for _ in range(PLAIN_STEPS)]
    save, call = save_step(trainer, ckpt)
    return {"plain": plain, "save": save, "call": call}


def async_round(trainer: Trainer, ckpt: Rank0Checkpointer) -> dict[str, Any]:
    plain = [timed_step(trainer) for _ in range(PLAIN_STEPS)]
    save, call = save_step(trainer, ckpt)
    staged_at, step = time.perf_counter(), trainer.global_step
    inflight = []
    while ckpt.saved_step != step:  # set by the writer thread once the checkpoint is complete on disk
        if len(inflight) >= MAX_INFLIGHT_STEPS:
            raise SystemExit(f"the background save of step {step} did not finish in {MAX_INFLIGHT_STEPS} steps")
        inflight.append(timed_step(trainer))
    written = time.perf_counter() - staged_at  # to within one step
    for _ in range(SETTLE_STEPS):
        timed_step(trainer)
    return {"plain": plain, "save": save, "call": call, "inflight": inflight, "written": written}


def staging_breakdown(trainer: Trainer, repeats: int = 3) -> dict[str, float]:
    """What bounds each figure: state dict, staging copy, memcpy; serialization (crc32), sha256 of a sync save."""

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times)

    state_fn = best(trainer.state)
    buffer = StagingBuffer(pin=False)
    started = time.perf_counter()
    buffer.stage(trainer.state())
    first_stage = time.perf_counter() - started
    warm_stage = best(lambda: buffer.stage(trainer.state()))
    nbytes = sum(t.numel() * t.element_size() for t in buffer.tensors.values())
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src).fill_(0.0)
    memcpy = best(lambda: dst.copy_(src))
    payload = memoryview(bytes(64 * 2**20))
    sha = best(lambda: hashlib.sha256(payload).digest())
    serialize = best(lambda: torch.save(buffer.tensors, _Discard()))
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        serialize_no_crc = best(lambda: torch.save(buffer.tensors, _Discard()))
    finally:
        torch.serialization.set_crc32_options(crc32)
    return {"state_fn": state_fn, "first_stage": first_stage, "warm_stage": warm_stage, "staged_bytes": nbytes,
            "memcpy_gbps": nbytes / memcpy / 1e9, "sha256_gbps": len(payload) / sha / 1e9,
            "serialize": serialize, "serialize_no_crc": serialize_no_crc}  # fmt: skip


class _Discard(io.RawIOBase):
    """A file that drops what is written to it: ``torch.save`` into it times serialization (and crc32) alone."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def raw_write(directory: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file on that disk and fsync it: the floor of any sync save."""
    path = directory / "raw-write.tmp"
    block = bytes(16 * 2**20)
    started = time.perf_counter()
    with open(path, "wb") as file:
        left = nbytes
        while left > 0:
            file.write(block[: min(left, len(block))])
            left -= len(block)
        file.flush()
        os.fsync(file.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def evict(path: Path) -> None:
    """Drop a (clean, fsynced) file's pages from the page cache so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resume_worker(rank: int, port: int, directory: Path, rounds: int, out: Path) -> None:
    """Rank 0 holds the checkpoint and sends it; rank 1 reads it from disk or receives it, then loads it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=RESUME_TIMEOUT_S))  # fmt: skip
    manifest, payload = next(scan(directory))
    source = str(directory / manifest.file)
    times: dict[str, list[float]] = {"disk (cold)": [], "disk (warm)": [], "broadcast": []}
    for round_ in range(rounds):
        order = ("disk", "broadcast") if round_ % 2 == 0 else ("broadcast", "disk")
        for way in order:
            if way == "disk":
                if rank == 1:
                    for kind in ("disk (cold)", "disk (warm)"):
                        if kind == "disk (cold)":
                            evict(directory / manifest.file)
                        started = time.perf_counter()
                        _, data = next(scan(directory))
                        load_state(data, source)
                        times[kind].append(time.perf_counter() - started)
                        del data
                dist.barrier()
            else:
                dist.barrier()
                started = time.perf_counter()
                _, data = _broadcast_bytes(payload if rank == 0 else b"", 0, None, "disk")
                if rank == 1:
                    load_state(data, source)
                    times["broadcast"].append(time.perf_counter() - started)
                del data
    dist.barrier()
    if rank == 1:
        out.write_text(json.dumps({"size": manifest.size, **times}))
    dist.destroy_process_group()


def resume_transfer(directory: Path, rounds: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = directory.parent / "resume.txt"
    context = mp.start_processes(resume_worker, args=(listen_port(), directory, rounds, out), nprocs=2,
                                 join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise SystemExit(f"the resume-transfer processes did not finish in {RESUME_TIMEOUT_S} s")
    return json.loads(out.read_text())


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed sync and async rounds each (default 5)")
    parser.add_argument("--layers", type=int, default=2, help="Linear(4096,4096) layers, 64 MiB each (default 2)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary checkpoint directory")
    args = parser.parse_args()
    logging.getLogger("service.state.checkpoint").setLevel(logging.WARNING)
    logging.getLogger("service.state.checkpoint_io").setLevel(logging.WARNING)

    trainer = Trainer(args.layers)
    print(f"model: {args.layers} x Linear({WIDTH},{WIDTH}), {trainer.param_bytes / MB:.0f} MB of fp32 parameters, "
          f"batch {BATCH}, {torch.get_num_threads()} torch threads; load average {os.getloadavg()[0]:.2f}",
          flush=True)  # fmt: skip
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.dir) as tmp:
        root = Path(tmp)
        # every_steps=1 and maybe_save called in save steps only (a call in any other step costs next to
        # nothing: it only reports a failed background save, which the next save step's call does too).
        # keep=1 holds the disk use to one checkpoint per directory.
        sync = Rank0Checkpointer(root / "sync", 1, 1, CONFIG_HASH, "stop", async_save=False)
        asyn = Rank0Checkpointer(root / "async", 1, 1, CONFIG_HASH, "stop", async_save=True)
        for _ in range(3):
            trainer.step()  # allocator and thread warm-up
        plain_all: list[float] = []
        stalls: dict[str, list[float]] = {"sync": [], "async": []}  # save step - median plain step of its round
        calls: dict[str, list[float]] = {"sync": [], "async": []}  # the maybe_save call alone
        inflight_all: list[float] = []
        slowdowns: list[float] = []  # median step while writing / median plain step, per async round
        written: list[float] = []
        for round_ in range(args.rounds + 1):
            order = ("sync", "async") if round_ % 2 == 0 else ("async", "sync")
            line = []
            for mode in order:
                result = sync_round(trainer, sync) if mode == "sync" else async_round(trainer, asyn)
                if round_ == 0:
                    continue  # warm-up: the first async save allocates its staging buffers
                plain = statistics.median(result["plain"])
                plain_all += result["plain"]
                stalls[mode].append(result["save"] - plain)
                calls[mode].append(result["call"])
                line.append(f"{mode} stall {ms(stalls[mode][-1])} ms (plain {ms(plain)} ms)")
                if mode == "async":
                    inflight_all += result["inflight"]
                    slowdowns.append(statistics.median(result["inflight"]) / plain)
                    written.append(result["written"])
                    line.append(f"{len(result['inflight'])} steps while writing, x{slowdowns[-1]:.2f}")
            if round_:
                print(f"round {round_}/{args.rounds}: " + ", ".join(line), flush=True)
        sync.close()
        asyn.close()
        size = next(scan(root / "sync"))[0].size

        breakdown = staging_breakdown(trainer)
        raw = raw_write(root, size)
        del trainer, sync, asyn
        resume = resume_transfer(root / "sync", RESUME_ROUNDS)

    med = statistics.median
    plain = med(plain_all)
    sync_stall, async_stall = med(stalls["sync"]), med(stalls["async"])
    sync_call, async_call = med(calls["sync"]), med(calls["async"])
    inflight = med(inflight_all)
    print(f"\ncheckpoint: {size / MB:.0f} MB; {args.rounds} rounds each, medians (ms)")
    print(f"{'':<30}{'stall':>10}{'maybe_save':>12}")
    print(f"{'plain step':<30}{ms(plain):>10}")
    print(f"{'sync save':<30}{ms(sync_stall):>10}{ms(sync_call):>12}   "
          f"({size / MB / sync_call:.0f} MB/s serialized, hashed, written, fsynced)")  # fmt: skip
    print(f"{'async save (staging)':<30}{ms(async_stall):>10}{ms(async_call):>12}   "
          f"({size / MB / async_call / 1e3:.1f} GB/s staged)")  # fmt: skip
    print(f"{'step while writing':<30}{ms(inflight):>10}{'':>12}   ({len(inflight_all)} steps)")
    print(f"{'background write':<30}{ms(med(written)):>10}{'':>12}   "
          f"({size / MB / med(written):.0f} MB/s, to within a step)")  # fmt: skip
    b = breakdown
    print(f"\nbounds: state_fn {ms(b['state_fn'])} ms; stage into warm buffers {ms(b['warm_stage'])} ms "
          f"({b['staged_bytes'] / b['warm_stage'] / 1e9:.1f} GB/s), into new ones {ms(b['first_stage'])} ms; "
          f"memcpy {b['memcpy_gbps']:.1f} GB/s")  # fmt: skip
    print(f"        torch.save alone {ms(b['serialize'])} ms ({ms(b['serialize_no_crc'])} ms without crc32); "
          f"sha256 {b['sha256_gbps']:.2f} GB/s ({ms(size / 1e9 / b['sha256_gbps'])} ms); "
          f"raw write+fsync {ms(raw)} ms ({size / MB / raw:.0f} MB/s)")  # fmt: skip
    print(f"\nstall ratio async/sync: {async_stall / sync_stall:.3f} (target <= 0.05); "
          f"maybe_save alone: {async_call / sync_call:.3f}")  # fmt: skip
    print(f"step slowdown while writing: {med(slowdowns):.3f} (median of rounds; "
          f"{inflight / plain:.3f} over all steps)")  # fmt: skip

    disk_cold, disk_warm = med(resume["disk (cold)"]), med(resume["disk (warm)"])
    bcast = med(resume["broadcast"])
    print(f"\nresume: {resume['size'] / MB:.0f} MB to rank 1 of 2, then load_state ({RESUME_ROUNDS} rounds, medians)")
    print(f"  disk: scan + verify, cache evicted   {ms(disk_cold):>8} ms")
    print(f"  disk: scan + verify, cache warm      {ms(disk_warm):>8} ms")
    print(f"  gloo broadcast from rank 0           {ms(bcast):>8} ms")
    print(f"broadcast/disk ratio: {bcast / disk_cold:.2f} (evicted), {bcast / disk_warm:.2f} (warm)")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other processes on this machine skew every figure)")


if __name__ == "__main__":
    main()
