"""SyncBatchNorm that works on CPU: batch statistics all-reduced in forward and backward.

torch's ``nn.SyncBatchNorm`` refuses CPU tensors. This layer computes the same
thing with a differentiable ``all_reduce``: the forward sums the statistics
across ranks, the backward sums their gradients, so N ranks × batch b train
exactly like one rank × batch N·b with plain BatchNorm.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

if TYPE_CHECKING:
    from service.telemetry.commtiming import WaitClock


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum over ranks is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup, clock: WaitClock | None,  # noqa: ANN001
                entered: Callable[[], None] | None) -> Tensor:  # fmt: skip
        ctx.group, ctx.clock, ctx.entered = group, clock, entered
        return _timed_sum(tensor, group, clock, entered)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: ANN001
        return _timed_sum(grad, ctx.group, ctx.clock, ctx.entered), None, None, None


def _timed_sum(tensor: Tensor, group: dist.ProcessGroup, clock: WaitClock | None,
               entered: Callable[[], None] | None = None) -> Tensor:  # fmt: skip
    """A summed copy; with a clock (the metrics exporter's), the time blocked in the all-reduce goes on it; with
    ``entered`` (the hang watchdog's progress record), this rank says it reached the collective."""
    total = tensor.clone()
    if entered is not None:
        entered()
    started = time.perf_counter()
    dist.all_reduce(total, group=group)
    if clock is not None:
        clock.add(time.perf_counter() - started)
    return total


def all_reduce_sum(tensor: Tensor, group: dist.ProcessGroup, clock: WaitClock | None = None,
                   entered: Callable[[], None] | None = None) -> Tensor:  # fmt: skip
    return _AllReduceSum.apply(tensor, group, clock, entered)


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm over the union of every rank's batch, for any input rank (1d, 2d, 3d)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.wait_clock: WaitClock | None = (
            None  # set by the metrics exporter (service.telemetry.commtiming.instrument)
        )
        self.on_collective: Callable[[], None] | None = None  # set by the loop: the hang watchdog's progress tick

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"AllReduceBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D.")

    def forward(self, input: Tensor) -> Tensor:
        """Statistics, normalisation and the affine part in float32 whatever the input's dtype, like torch's
        own BatchNorm under autocast: a bf16/fp16 input (``train.amp``) gives an output of its dtype, while
        the running statistics and the all-reduced sums stay float32."""
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)
        dtype = input.dtype
        x = input.float()
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = x.new_full((1,), x.numel() / x.size(1))
        sums = all_reduce_sum(torch.cat([x.sum(dims), local_count]), self._group(), self.wait_clock,
                              self.on_collective)  # fmt: skip
        count = sums[-1]
        mean = sums[:-1] / count
        centered = x - mean.view(shape)
        var = all_reduce_sum((centered * centered).sum(dims), self._group(), self.wait_clock,
                             self.on_collective) / count  # fmt: skip
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count.detach())
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        return out.to(dtype)

    def _group(self) -> dist.ProcessGroup:
        return cast(dist.ProcessGroup, self.process_group or dist.group.WORLD)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, count: Tensor) -> None:
        # With track_running_stats the three buffers exist (torch types them Optional).
        tracked, running_mean, running_var = (
            cast(Tensor, buffer) for buffer in (self.num_batches_tracked, self.running_mean, self.running_var)
        )
        tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(tracked)
        unbiased = var * count / (count - 1).clamp(min=1)
        running_mean.lerp_(mean, factor)
        running_var.lerp_(unbiased, factor)


def tick_collectives(model: nn.Module, entered: Callable[[], None]) -> None:
    """Every layer of ``model`` that runs collectives of its own (this module's SyncBatchNorm) calls ``entered``
    as it enters each one."""
    for module in model.modules():
        if isinstance(module, AllReduceBatchNorm):
            module.on_collective = entered


def convert_sync_batchnorm(module: nn.Module, device_type: str,
                           process_group: dist.ProcessGroup | None = None) -> nn.Module:  # fmt: skip
    """torch's SyncBatchNorm on CUDA, :class:`AllReduceBatchNorm` elsewhere."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert_cpu(module, process_group)


def _convert_cpu(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, AllReduceBatchNorm):
        converted = AllReduceBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats, process_group,
        )  # fmt: skip
        with torch.no_grad():
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, _convert_cpu(child, process_group))
    return converted
