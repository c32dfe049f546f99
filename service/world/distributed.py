"""Process group and device: chosen from the world info, initialised once, destroyed in ``finally``."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from service.world.env import EnvError, WorldInfo

log = logging.getLogger(__name__)

STORE_PREFIX = "ddp-service"


@dataclasses.dataclass(frozen=True)
class DistContext:
    """What the rest of the job needs to know about communication: backend, device, control group.

    ``control`` carries the small host-side collectives (the preemption flag,
    the resume agreement, checkpoint bytes): a gloo group of its own, so they
    never touch the GPU stream nor queue behind DDP's gradient all-reduces.

    ``store``: the process group's store (:func:`attempt_store`), which the
    hang watchdog clones for its own connection; ``store_host``: who serves it,
    for the watchdog's message when it stops answering.
    """

    backend: str
    device: torch.device
    control: Any = None
    began: float | None = None  # Unix times: the process group's set-up entered (it waits for every peer) ...
    up: float | None = None  # ... and done (the goodput ledger's rendezvous share of this worker)
    store: Any = None
    store_host: str = "this process"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def select_backend(requested: str, cuda_available: bool) -> str:
    """NCCL when CUDA devices are visible, gloo otherwise, unless the config names one."""
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise EnvError("dist.backend is 'nccl' but no CUDA device is visible. Use 'auto' or 'gloo' on CPU machines.")
    return requested


def select_device(world: WorldInfo, backend: str, device_count: int) -> torch.device:
    """``cuda:LOCAL_RANK``; index 0 when the launcher gives each process one visible device."""
    if backend != "nccl":
        return torch.device("cpu")
    if device_count == 1:
        return torch.device("cuda", 0)
    if world.local_rank >= device_count:
        raise EnvError(
            f"LOCAL_RANK={world.local_rank} but only {device_count} CUDA devices are visible. Start at most "
            f"{device_count} processes per node (--nproc_per_node) or fix CUDA_VISIBLE_DEVICES."
        )
    return torch.device("cuda", world.local_rank)


def store_namespace(world: WorldInfo) -> str:
    """The key prefix for this attempt's process group.

    Under torchrun's shared agent store (TORCHELASTIC_USE_AGENT_STORE=True, the
    default) the store outlives attempts: without a per-attempt prefix,
    restarted workers read the previous attempt's gloo addresses and fail with
    "Gloo connectFullMesh failed ... Connection refused".

    When the agent does not share its store (the etcd3 rendezvous turns sharing
    off) worker rank 0 hosts a fresh store every round, so no attempt number is
    needed, and none may be used: TORCHELASTIC_RESTART_COUNT is per agent. An
    agent restarting for a failure counts up, one restarting for a membership
    change does not, and prefixes keyed on it would split the world.
    """
    if world.use_agent_store:
        return f"{STORE_PREFIX}/attempt-{world.restart_count}/"
    return f"{STORE_PREFIX}/"


def store_host(world: WorldInfo) -> str:
    """Who serves :func:`attempt_store`'s store: rank 0 (a store of its own each round) or the torchrun agent."""
    if world.world_size == 1:
        return "this process"
    return "the torchrun agent" if world.use_agent_store else "rank 0"


def attempt_store(world: WorldInfo, timeout: timedelta) -> dist.Store:
    """The process group's store: the agent's (shared) one, or one that rank 0 hosts."""
    if world.world_size == 1:
        base: dist.Store = dist.HashStore()
    else:
        base = dist.TCPStore(
            host_name=world.master_addr or "127.0.0.1",
            port=world.master_port or 0,
            world_size=world.world_size,
            is_master=world.rank == 0 and not world.use_agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
    return dist.PrefixStore(store_namespace(world), base)


def init_distributed(world: WorldInfo, requested_backend: str, timeout_seconds: int) -> DistContext:
    """Create the default process group for this world (a world of 1 too, so collectives always work)."""
    began = time.time()
    backend = select_backend(requested_backend, torch.cuda.is_available())
    device = select_device(world, backend, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_seconds)
    store = attempt_store(world, timeout)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=world.rank,
        world_size=world.world_size,
        timeout=timeout,
    )
    control = dist.new_group(backend="gloo")
    log.info("process group up: attempt %d backend=%s device=%s world_size=%d intra-op threads=%d",
             world.restart_count, backend, device, world.world_size, torch.get_num_threads())  # fmt: skip
    return DistContext(
        backend=backend,
        device=device,
        control=control,
        began=began,
        up=time.time(),
        store=store,
        store_host=store_host(world),
    )


def bytes_to_tensor(payload: bytes, length: int | None = None) -> torch.Tensor:
    """``payload`` as a CPU uint8 tensor for a collective, zero-padded to ``length``; one copy."""
    tensor = torch.zeros(len(payload) if length is None else length, dtype=torch.uint8)
    if payload:
        tensor.numpy()[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)  # reads bytes without a copy
    return tensor


def tensor_to_bytes(tensor: torch.Tensor, length: int) -> bytes:
    """The first ``length`` bytes of a uint8 tensor that a collective filled."""
    return tensor[:length].numpy().tobytes()


def all_gather_bytes(payload: bytes, group: Any, world_size: int) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank: the sizes first, then the bytes padded to the largest.
    A collective over ``group`` (the gloo control group: host memory, no device)."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    lengths = [int(size.item()) for size in sizes]
    longest = max(lengths)
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(buffers, bytes_to_tensor(payload, longest), group=group)
    return [tensor_to_bytes(buffer, length) for buffer, length in zip(buffers, lengths, strict=True)]


def all_agree(group: Any) -> Callable[[Sequence[int]], list[int]]:
    """A collective: the smallest of each integer over the ranks of ``group`` (e.g. 'every rank has a batch')."""

    def smallest(values: Sequence[int]) -> list[int]:
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        return [int(value) for value in tensor.tolist()]

    return smallest


def largest_across(group: Any) -> Callable[[int], int]:
    """A collective: the largest of one integer over the ranks of ``group`` (:func:`all_agree`, negated)."""
    smallest = all_agree(group)
    return lambda value: -smallest([-value])[0]


def any_rank(group: Any) -> Callable[[int, int], Callable[[], tuple[int, int]]]:
    """The preemption check's collective: (the largest rank's code, the smallest rank's proposal), one all-reduce.
    It starts without waiting; the call it returns waits for it and reads it."""

    def agree(local: int, proposal: int) -> Callable[[], tuple[int, int]]:
        values = torch.tensor([int(local), -proposal], dtype=torch.int64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)

        def agreed() -> tuple[int, int]:
            work.wait()
            return int(values[0]), int(-values[1])

        return agreed

    return agree


def sum_across(group: Any) -> Callable[[Sequence[float]], list[float]]:
    """A collective: each value summed over the ranks of ``group``, in one float64 all-reduce.

    For host numbers (the log window's loss sum, step count, throughput) on the
    gloo control group: no device tensor, no device sync, and it never queues
    behind DDP's gradient all-reduces.
    """

    def total(values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor, group=group)
        return [float(value) for value in tensor.tolist()]

    def alone(values: Sequence[float]) -> list[float]:
        return [float(value) for value in values]  # a world of one: its sums are its own (a log step's 56 µs)

    return alone if dist.get_world_size(group) == 1 else total


def barrier(group: Any) -> None:
    """A collective: returns once every rank of ``group`` has called it."""
    dist.barrier(group=group)


@contextlib.contextmanager
def distributed(world: WorldInfo, requested_backend: str, timeout_seconds: int) -> Iterator[DistContext]:
    """The process group for the body of a ``with``, torn down safely however the body ends.

    Build the DDP model inside a function called from the body, so that it is
    freed when that function returns; on an exception its traceback's frames
    are cleared here, or they would keep the model alive past the group.
    """
    context = init_distributed(world, requested_backend, timeout_seconds)
    try:
        yield context
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        shutdown_distributed()


def shutdown_distributed() -> None:
    """Free what still holds the process group, then destroy it.

    DDP's reducer sits in reference cycles, so it lives until the cyclic GC
    runs. Collected late (at interpreter exit, or while the GIL is held by a
    dealloc) it drops the last reference to a gloo group, whose destructor joins
    worker threads that need the GIL: the worker hangs or aborts at exit. The
    caller must have released the job; collecting here leaves the registry's
    reference as the last one, which ``destroy_process_group`` drops cleanly.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
