"""``train.nonfinite``: what a step whose gradient norm is inf or nan does.

The signal is the global gradient norm after DDP's all-reduce: the same value
on every rank (a nan loss on one rank makes every rank's averaged gradient
nan), so all ranks decide alike without another collective. With
``train.grad_clip`` set, ``clip_grad_norm_`` computes it anyway; otherwise it
is one extra norm over the gradients.

- ``stop`` (the default): the update runs, and the first bad step is recorded
  *on the device* (``torch.where``, no host sync: a CUDA step stays
  asynchronous). The record is read only where the loop reads the device
  anyway: at log steps, at checkpoint steps, at the last step, and before any
  save. So training stops, naming that step and the last checkpoint before
  it, at most ``log_every`` steps later, and a checkpoint holding nan weights
  is never written.
- ``skip``: the optimizer step is skipped and counted
  (``nonfinite_steps`` in summary.json). Deciding whether to run
  ``optimizer.step()`` needs the flag on the host: one sync per step on CUDA,
  the same one torch's ``GradScaler`` pays to skip a step. Zeroing the
  gradients instead would keep it asynchronous but is no skip (momentum and
  weight decay still move the weights).

Under ``train.amp: fp16`` (:mod:`service.model.precision`) the gradients are
unscaled before the norm, so clipping and this check see true values, and the
norm is read on the host every step (``GradScaler.step`` reads its inf flag
anyway). A non-finite step is then skipped under either policy, as the scaler
always does, and counted in ``nonfinite_steps`` with a warning naming the
scale. Such a skip does *not* trip ``stop``: overflowing now and then is how
the scaler finds its scale (it starts at 2**16 and halves at each overflow),
not a diverged loss. A diverged loss overflows at every step, though, and the
scale keeps halving; once a step overflows at a scale of 1 or less, scaling
cannot be the cause (the scaled gradients are no larger than the true ones),
so ``stop`` fails there, naming the first step of that run of skips: about 17
steps after a divergence from the initial scale. The skipped steps never
reached the weights, so every checkpoint stays finite.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from service.config import JobConfig
from service.model.precision import Precision
from service.state.checkpoint_io import candidate_steps, state_name

log = logging.getLogger(__name__)

FOLD = 64  # steps whose norms are kept before they are folded into the record (the checks come sooner by default)


class NonfiniteError(RuntimeError):
    """A step's gradient norm was inf or nan under ``train.nonfinite: stop``."""


class NonfiniteGuard:
    def __init__(self, policy: str, grad_clip: float | None, device: torch.device, checkpoints: Path,
                 check_every: Iterable[int], last_step: int, precision: Precision | None = None) -> None:  # fmt: skip
        self.policy = policy
        self.precision = precision or Precision(None, device, None)
        self.grad_clip = grad_clip
        self.checkpoints = checkpoints
        self.check_every = tuple(every for every in check_every if every)
        self.last_step = last_step
        self.skipped = 0
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self._norms: list[tuple[int, Tensor]] = []  # (step, its gradient norm) not yet folded into _first_bad
        self._overflows_from: int | None = None  # the first of the steps the scaler skipped in a row
        self._detail = ""
        self.fix = "Lower train.lr, set train.grad_clip, or set train.nonfinite=skip to skip such steps"

    @classmethod
    def for_job(cls, config: JobConfig, device: torch.device, total_steps: int,
                precision: Precision | None = None, grad_clip: float | None = None) -> NonfiniteGuard:  # fmt: skip
        """Checks at log steps, checkpoint steps and the last step: where the loop reads the device anyway.
        ``grad_clip``: what ``train.grad_clip`` resolved to for the task (:func:`service.model.optim.clip_setting`)."""
        train = config.train
        return cls(train.nonfinite, grad_clip, device, Path(config.run_dir) / "checkpoints",
                   (train.log_every, config.checkpoint.every_steps), total_steps, precision)  # fmt: skip

    def step(self, params: list[Tensor], optimizer: torch.optim.Optimizer, step: int) -> None:
        """Unscale (fp16), clip (when configured), then step as the policy says; ``step`` counts from 1."""
        self.precision.unscale(optimizer)
        if self.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(params, self.grad_clip)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            # One fused (foreach) norm over all gradients, as clip_grad_norm_ computes it: not a kernel per tensor.
            norm = nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self._first_bad.device)
        if self.policy == "skip" or self.precision.scaler is not None:
            if not bool(torch.isfinite(norm)):  # the one host sync per step that skipping costs
                self._skip(step, float(norm))
                return
            self._overflows_from = None
        else:  # recorded now, folded into the record when it is read (four device ops a step, before)
            self._norms.append((step, norm))
            if len(self._norms) >= FOLD:
                self._fold()
        self.precision.step(optimizer)

    def _fold(self) -> None:
        """The recorded steps' norms into ``_first_bad``: the first step whose norm is not finite, if none before."""
        if not self._norms:
            return
        steps, norms = zip(*self._norms, strict=True)
        self._norms = []
        bad = torch.tensor(steps, dtype=torch.int64).to(self._first_bad.device, non_blocking=True)
        unset = torch.iinfo(torch.int64).max
        first = torch.where(torch.isfinite(torch.stack(norms)), unset, bad).min()
        self._first_bad = torch.where((self._first_bad >= 0) | (first == unset), self._first_bad, first)

    def _skip(self, step: int, norm: float) -> None:
        self.skipped += 1
        scale = self.precision.scale  # the scale this step's loss was multiplied by
        self.precision.skip()
        if scale is None:
            log.warning("step %d: the gradient norm is %s; its update is skipped (train.nonfinite=skip, %d so "
                        "far)", step, norm, self.skipped)  # fmt: skip
            return
        self._overflows_from = self._overflows_from or step
        log.warning("step %d: the gradient norm is %s under train.amp=fp16; the gradient scaler skips its update "
                    "and lowers its scale from %g to %g (%d skipped so far)", step, norm, scale,
                    self.precision.scale, self.skipped)  # fmt: skip
        if self.policy == "stop" and scale <= 1.0 and self.first_bad.item() < 0:
            self._first_bad.fill_(self._overflows_from)
            self._detail = (f" Under train.amp=fp16 the gradient scaler skipped every step from {self._overflows_from}"
                            f" to {step} and lowered its scale to {scale:g}, where scaling cannot be what "
                            "overflows; no skipped step reached the weights.")  # fmt: skip

    def check(self, step: int) -> None:
        """After each optimizer step: reads the device only at steps where the loop syncs anyway."""
        if step == self.last_step or any(step % every == 0 for every in self.check_every):
            self.raise_if_bad()

    @property
    def first_bad(self) -> Tensor:
        """The device record of the first non-finite step (-1: none yet), read without a host sync."""
        self._fold()
        return self._first_bad

    def raise_if_bad(self) -> None:
        if self.policy != "stop":
            return
        bad = int(self.first_bad.item())
        if bad < 0:
            return
        good = [step for step in candidate_steps(self.checkpoints) if step < bad]
        last = str(self.checkpoints / state_name(good[0])) if good else "none (no checkpoint before that step)"
        raise NonfiniteError(
            f"The gradient norm at step {bad} is not finite (inf or nan): the loss diverged.{self._detail} The last "
            f"good checkpoint is {last}. {self.fix}; a rerun resumes from that checkpoint."
        )
