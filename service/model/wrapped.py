"""DDP as the service wraps a module: the settle step at the first forward of every start, the hang watchdog's
marks, the user module's own attributes, and a wrapper that stays usable after its session ends.

- **Settle.** DDP regroups its gradient buckets once, after a process's first
  backward, in the order the gradients became ready. With 3 or more ranks the
  bucket layout decides in which order the all-reduce adds each element across
  ranks, so a process that resumes at step k would reduce step k's gradients in
  the initial layout while the uninterrupted run used the regrouped one: the
  weights would differ in the last bits. So the first forward with gradients
  of every start first runs the same inputs once more, in eval mode (no
  BatchNorm statistics move, no dropout), under a forked RNG, and backpropagates
  zero through the outputs: every real step sees the regrouped layout, and the
  parameters, buffers, gradients (put back as they were) and RNG are as before.
  It needs no loss: a script's own loop has none to give. Worlds of 1 and 2
  skip it (two numbers add up the same in either order).
- **Marks.** Each forward marks the rank's progress record (``forward``, then
  ``backward`` once it returns), counted within the step, so the watchdog tells
  a rank that loops in its forward from one that waits in the gradient
  all-reduce (:mod:`service.telemetry.progress`).
- **Attributes.** ``model.init_hidden(...)``, ``model.config``: what the wrapped
  module has, the wrapper answers (as Lightning Fabric's wrapper does); its
  ``state_dict`` is the module's, without DDP's ``module.`` prefix.
- **Timed.** With the metrics exporter, DDP's own work before the module's forward
  (the buffer broadcast) is timed here, in :meth:`ServiceDDP._pre_forward`
  (:meth:`ServiceDDP.time_pre_forward`): forward pre-hooks would do it too, but a
  module with hooks leaves torch's fast call path, 5-10 µs a forward.
- **Released.** When its session ends the wrapper drops DDP's reducer and
  process group (the group is destroyed next) and forwards to the module alone:
  a script that generates samples after training still can.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from service.config.errors import backward, ddp_hint
from service.data.batches import tensors
from service.telemetry.progress import Progress


class ServiceDDP(DistributedDataParallel):
    """``DistributedDataParallel`` with the service's settle step, progress marks, attribute forwarding and release."""

    def __init__(self, module: torch.nn.Module, *args: Any, settle: bool = False, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self._settle_pending = settle
        self._progress: Progress | None = None
        self._released = False
        self._pre_forward_clock: Callable[[float], None] | None = None

    def time_pre_forward(self, clock: Callable[[float], None]) -> None:
        """Hand ``clock`` the seconds of DDP's pre-forward work (the buffer broadcast) at each forward."""
        self._pre_forward_clock = clock

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        clock = self._pre_forward_clock
        if clock is None:
            return super()._pre_forward(*inputs, **kwargs)
        began = time.perf_counter()
        try:
            return super()._pre_forward(*inputs, **kwargs)
        finally:
            clock(time.perf_counter() - began)

    def watch(self, progress: Progress) -> None:
        """Mark ``progress`` at each forward (the hang watchdog's record)."""
        self._progress = progress

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._released:
            return self.module(*inputs, **kwargs)
        if self._settle_pending and torch.is_grad_enabled():
            self._settle_pending = False
            self._settle(inputs, kwargs)
        progress = self._progress
        if progress is not None:
            progress.forward_started()
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            raise ddp_hint(exc) from exc
        finally:
            if progress is not None:
                progress.forward_done()

    def _settle(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        params = [parameter for parameter in self.module.parameters() if parameter.requires_grad]
        grads = [parameter.grad for parameter in params]
        for parameter in params:
            parameter.grad = None
        was_training, syncs, clock = self.training, self.require_backward_grad_sync, self._pre_forward_clock
        self.require_backward_grad_sync = True  # the first micro-step of an accumulation runs under no_sync
        self._pre_forward_clock = None  # the settle step is no step's wait
        self.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                output = super().forward(*inputs, **kwargs)
                parts = [tensor.float().sum() for tensor in tensors(output) if tensor.requires_grad]
                if parts:
                    backward(torch.stack(parts).sum() * 0)  # the in-place error gets its hint here too
        finally:
            for parameter, grad in zip(params, grads, strict=True):
                parameter.grad = grad
            self.train(was_training)
            self.require_backward_grad_sync = syncs
            self._pre_forward_clock = clock

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own state dict: its keys as in the script's model, no ``module.`` prefix."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Into the module, with its own keys (what :meth:`state_dict` gives)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def release(self) -> None:
        """The session is over: drop what holds the process group; forward to the module alone from now on."""
        self._released = True
        self._progress = None
        for name in ("reducer", "logger", "process_group", "_comm_hooks"):
            with contextlib.suppress(AttributeError, KeyError):
                self.__dict__.pop(name)
