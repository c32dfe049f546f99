"""``train.amp``: the autocast dtype of the forward, and for fp16 the gradient scaler around backward and step.

- ``bf16`` (and ``auto`` on CUDA): autocast only. bf16 has fp32's exponent
  range, so gradients do not underflow and no scaler is needed.
- ``fp16``: autocast to float16 plus :class:`torch.amp.GradScaler`. The loss
  is multiplied by the scale before backward, so small fp16 activation
  gradients do not flush to zero; the step unscales the gradients first (the
  gradient norm, clipping and the non-finite check see true values), and a
  step whose gradients overflowed is skipped and the scale halved. The
  scaler's state (scale, growth tracker) is part of every checkpoint, so a
  resumed run scales exactly as the uninterrupted one. It runs on CPU too
  (torch's CPU autocast covers float16 for conv, linear and matmul; slower
  than fp32 there: it is for testing a CUDA job's setting on a laptop).
- ``off`` (and ``auto`` on CPU): neither.

With no scaler every method is the plain fp32 path, so the loop has no
precision checks of its own. The policy for non-finite steps (what a scaler
skip counts as) is :mod:`service.model.nonfinite`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from service.config.errors import backward

# What GradScaler's state_dict holds; a checkpoint's entry is checked against it before it is loaded.
_SCALER_KEYS = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                "_growth_tracker": int}  # fmt: skip


class PrecisionStateError(ValueError):
    """A checkpoint's ``scaler`` entry is not a gradient scaler's state."""


class Precision:
    def __init__(self, dtype: torch.dtype | None, device: torch.device, scaler: torch.amp.GradScaler | None) -> None:
        self.dtype, self.device, self.scaler = dtype, device, scaler

    @classmethod
    def for_job(cls, setting: str, device: torch.device) -> Precision:
        """``auto``: bf16 on CUDA, off on CPU; ``bf16``; ``fp16`` (with a gradient scaler); ``off``."""
        if setting == "fp16":
            return cls(torch.float16, device, torch.amp.GradScaler(device.type))
        if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
            return cls(torch.bfloat16, device, None)
        return cls(None, device, None)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: Tensor) -> None:
        """Backward of the (scaled) loss; the in-place autograd error keeps its hint."""
        backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    @property
    def scale(self) -> float | None:
        """The scale this step's loss was multiplied by (a host read), or None without a scaler."""
        return self.scaler.get_scale() if self.scaler is not None else None

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place, before anything reads them (norm, clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of a step whose gradients are finite; the scaler may grow its scale after."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def skip(self) -> None:
        """A step whose gradients are not finite runs no update; the scaler halves its scale."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        """The checkpoint's ``scaler`` entry: None without a scaler (bf16 and fp32 need none)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: Any, source: str = "the checkpoint") -> None:
        """Restore the scaler from a checkpoint's ``scaler`` entry, checked first.

        Without a scaler there is nothing to restore (``train.amp`` cannot change
        across a resume, so the entry is None then). With one, the entry must be
        a scaler's state with a positive finite scale; None (a checkpoint that
        had no scaler) is refused rather than silently started at the initial
        scale, which would not resume exactly.
        """
        if self.scaler is None:
            return
        if not isinstance(state, Mapping) or set(state) != set(_SCALER_KEYS):
            raise PrecisionStateError(
                f"{source} has no gradient scaler state (its 'scaler' entry is {_describe(state)}), but "
                "train.amp=fp16 needs one to resume exactly. Resume it with the train.amp it was written with, "
                "or start afresh with --set checkpoint.resume=never."
            )
        for key, kind in _SCALER_KEYS.items():
            value = state[key]
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (value < 0 if key == "_growth_tracker" else value <= 0):
                raise PrecisionStateError(
                    f"{source}'s gradient scaler state has {key}={value!r}; it must be a "
                    f"{'non-negative' if key == '_growth_tracker' else 'positive'} finite {kind.__name__}. "
                    "The checkpoint is damaged: delete it to resume from the one before, or start afresh with "
                    "--set checkpoint.resume=never."
                )
        self.scaler.load_state_dict({key: kind(state[key]) for key, kind in _SCALER_KEYS.items()})


def _describe(state: Any) -> str:
    if isinstance(state, Mapping):
        return f"a mapping of {sorted(map(str, state))[:8]}"
    return "None" if state is None else f"a {type(state).__name__}"
