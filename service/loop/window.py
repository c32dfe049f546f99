"""The scalars a loop logs and its throughput between two log lines: summed on the device, read once per window.

Every step may log named scalars (a task's ``loss`` and its ``step_fn``'s extra
numbers; a script's ``s.log(loss_D=..., loss_G=...)``): 0-d tensors are added
up on the device without a sync, numbers on the host. At each log step (the
same steps on every rank) one all-reduce of host numbers (``world_sum``, on the
control group) adds the world's sums, counts and throughput to this rank's own:
the window's one device read is the stack of its sums. The names are agreed
once, at the first report; a name no rank had logged before joins them at the
report that first sees it (one gather of the names, that report only).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from service.state.loop_state import LoopState
from service.telemetry.metrics import StepReport


class LogError(TypeError):
    """A value passed to ``log`` is not a scalar; the message names the call and the fix."""


def scalar(name: str, value: Any, call: str = "s.log") -> Tensor | float:
    """``value`` as a detached 0-d tensor or a float; :class:`LogError` for anything else."""
    if type(value) is Tensor and value.dtype is torch.float32 and not value.requires_grad and not value.dim():
        return value  # a detached float loss, the common case: as it is (the window copies it when it adds it)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise LogError(
                f"{call}({name}=...) got a tensor of shape {tuple(value.shape)}; log one number per "
                f"name: a 0-d tensor (e.g. {name}.mean()) or a Python number ({name}.item())."
            )
        if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64, torch.bool)):
            raise LogError(f"{call}({name}=...) got a {value.dtype} tensor; log a real number.")
        return value.detach().reshape(()).float()
    if isinstance(value, Real) and not isinstance(value, bool):
        return float(value)
    raise LogError(f"{call}({name}=...) got {type(value).__name__}; log a number or a 0-d tensor "
                   f"(e.g. {call}({name}=loss.detach())).")  # fmt: skip


class Window:
    """Sums since the last log line; :meth:`report` is a collective (the same steps on every rank)."""

    def __init__(self, device: torch.device, world_sum: Callable[[Sequence[float]], list[float]],
                 gather_names: Callable[[bytes], list[bytes]]) -> None:  # fmt: skip
        self.device = device
        self.world_sum = world_sum
        self.gather_names = gather_names
        self.names: list[str] = []  # agreed across the ranks, in the order they joined
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, int] = {}
        self.steps = 0
        self.samples = 0
        self.started = time.perf_counter()

    def log(self, name: str, value: Tensor | float) -> None:
        total = self.sums.get(name)
        if total is None:
            self.sums[name] = value.clone() if isinstance(value, Tensor) else value
            self.counts[name] = 1
            return
        if isinstance(total, Tensor):
            total += value  # in place: no allocation per step
        else:
            self.sums[name] = total + value
        self.counts[name] += 1

    def step(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples

    def _host(self) -> dict[str, float]:
        """This window's sums on the host: one read of the device for all of them."""
        on_device = [name for name, value in self.sums.items() if isinstance(value, Tensor)]
        read = torch.stack([self.sums[name].to(self.device) for name in on_device]).tolist() if on_device else []
        from_device = dict(zip(on_device, read, strict=True))
        return {name: from_device[name] if name in from_device else float(value)
                for name, value in self.sums.items()}  # in the order they were logged  # fmt: skip

    def report(self, state: LoopState, total_steps: int, lr: float | None) -> StepReport:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        sums, steps, rate = self._host(), max(1, self.steps), self.samples / elapsed
        unknown = [name for name in sums if name not in self.names]
        first = not self.names
        totals = self.world_sum([float(len(unknown) or first), steps, rate, *self._vector(sums)])
        if totals[0]:  # a name joins (or the first report): agree on the list, then sum again
            self._agree(unknown)
            totals = self.world_sum([0.0, steps, rate, *self._vector(sums)])
        _, world_steps, world_rate, *world = totals
        own = {name: sums[name] / self.counts[name] for name in self.names if self.counts.get(name)}
        everyone = {name: world[2 * index] / world[2 * index + 1] for index, name in enumerate(self.names)
                    if world[2 * index + 1]}  # fmt: skip
        report = StepReport(
            global_step=state.global_step,
            total_steps=total_steps,
            epoch=state.epoch,
            loss=own.get("loss"),
            lr=lr,
            samples_seen=state.samples_seen,
            rank_samples_per_second=rate,
            world_loss=everyone.get("loss"),
            world_samples_per_second=world_rate,
            seconds_per_step=elapsed / steps,
            values=own,
            world_values=everyone,
        )
        self.reset()
        return report

    def _vector(self, sums: dict[str, float]) -> list[float]:
        return [number for name in self.names for number in (sums.get(name, 0.0), float(self.counts.get(name, 0)))]

    def _agree(self, unknown: list[str]) -> None:
        gathered = self.gather_names(json.dumps(unknown).encode())
        for raw in gathered:
            for name in json.loads(raw):
                if name not in self.names:
                    self.names.append(name)
