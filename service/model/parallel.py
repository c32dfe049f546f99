"""The one place where a model is wrapped for parallel training."""

from __future__ import annotations

import inspect
import logging
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from service.config import DDPConfig, TrainConfig
from service.config.errors import ddp_hint
from service.model.syncbn import convert_sync_batchnorm
from service.model.wrapped import ServiceDDP
from service.world.env import EnvError, WorldInfo

log = logging.getLogger(__name__)


def wants_sync_batchnorm(setting: str, world_size: int) -> bool:
    return setting == "on" or (setting == "auto" and world_size > 1)


def wrap_model(model: nn.Module, train: TrainConfig, ddp: DDPConfig, world: WorldInfo,
               device: torch.device) -> nn.Module:  # fmt: skip
    """BatchNorm → SyncBatchNorm when asked, move to the device, compile when asked, then DDP (or DataParallel).

    The DDP wrapper is :class:`~service.model.wrapped.ServiceDDP`: it settles DDP's buckets at the first forward of
    every start (so a resume stays bit-exact at any world size) and marks the hang watchdog's progress record."""
    if train.strategy == "dp":
        return _data_parallel(model.to(device), world, device)
    if wants_sync_batchnorm(train.sync_batchnorm, world.world_size):
        model = convert_sync_batchnorm(model, device.type)
    model = model.to(device)
    if train.compile:
        compile_in_place(model, "inductor" if train.compile is True else train.compile)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            return ServiceDDP(
                model,
                settle=world.world_size >= 3,  # the bucket layout decides the order of the sums only from 3 ranks
                device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=ddp.find_unused_parameters,
                # None keeps torch's default: 25 MiB buckets after a small first one, so the
                # all-reduce of the last layers' gradients starts while backward still runs.
                bucket_cap_mb=ddp.bucket_cap_mb,
                **_buffer_sync_kwargs(ddp.broadcast_buffers),
            )
    except RuntimeError as exc:  # DDP's first broadcast of the buffers
        raise ddp_hint(exc) from exc


def compile_in_place(model: nn.Module, backend: str) -> None:
    """``train.compile``: ``model.compile()``, before the DDP wrap, as torch's docs advise for DDP.

    In place, so the module stays itself: its state_dict has no ``_orig_mod.``
    prefix (checkpoints of compiled and eager runs are interchangeable), and
    DDP still wraps the real module (``no_sync``, the comm hook, the bucket
    settling work unchanged). The forward runs inside DDP's, so dynamo splits
    the graph at DDP's bucket boundaries (its DDPOptimizer) and the
    all-reduce still overlaps backward. Compilation itself is lazy: the first
    forward pays it (tens of seconds with inductor on a small CPU).
    """
    started = time.perf_counter()
    model.compile(backend=backend)
    log.info("train.compile: %s backend; the first step compiles the model (%.2f s to set up)", backend,
             time.perf_counter() - started)  # fmt: skip


def _buffer_sync_kwargs(broadcast_buffers: bool) -> dict[str, Any]:
    """``ddp.broadcast_buffers: false`` leaves the buffers alone, at the wrap and at every forward.

    torch 2.13 renames the per-forward broadcast ``forward_sync_buffers``, which
    still broadcasts buffers when DDP wraps the model; only the old
    ``broadcast_buffers=False`` skips that too (a buffer that is a view of
    shared memory fails it). Every rank builds its buffers from the same seed.
    """
    if broadcast_buffers and "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": broadcast_buffers}


def _data_parallel(model: nn.Module, world: WorldInfo, device: torch.device) -> nn.Module:
    """The seed's section 二: one process drives every visible GPU with threads."""
    if world.world_size > 1:
        raise EnvError(
            f"train.strategy is 'dp' but the launcher started {world.world_size} processes. DataParallel "
            "runs in one process: start it without torchrun (python -m service train ...) or use "
            "train.strategy=ddp."
        )
    if device.type != "cuda":
        log.warning("train.strategy=dp on CPU: running as a single process without DataParallel.")
        return model
    return DataParallel(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model under DDP/DataParallel and torch.compile wrappers: no 'module.' or '_orig_mod.' prefix.

    ``train.compile`` compiles in place (no wrapper), but a task may hand over
    a ``torch.compile(model)`` of its own: an ``OptimizedModule``, stripped
    too, so its checkpoints load into the eager model and back.
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif _is_compiled_wrapper(model):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def _is_compiled_wrapper(model: nn.Module) -> bool:
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: not worth dynamo's 2 s import
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)
