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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from service.config import JobConfig
from service.state.checkpoint_io import candidate_steps, state_name

log = logging.getLogger(__name__)


class NonfiniteError(RuntimeError):
    """A step's gradient norm was inf or nan under ``train.nonfinite: stop``."""


class NonfiniteGuard:
    def __init__(self, policy: str, grad_clip: float | None, device: torch.device, checkpoints: Path,
                 check_every: Iterable[int], last_step: int) -> None:  # fmt: skip
        self.policy = policy
        self.grad_clip = grad_clip
        self.checkpoints = checkpoints
        self.check_every = tuple(every for every in check_every if every)
        self.last_step = last_step
        self.skipped = 0
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)

    @classmethod
    def for_job(cls, config: JobConfig, device: torch.device, total_steps: int) -> NonfiniteGuard:
        """Checks at log steps, checkpoint steps and the last step: where the loop reads the device anyway."""
        train = config.train
        return cls(train.nonfinite, train.grad_clip, device, Path(config.run_dir) / "checkpoints",
                   (train.log_every, config.checkpoint.every_steps), total_steps)  # fmt: skip

    def step(self, params: list[Tensor], optimizer: torch.optim.Optimizer, step: int) -> None:
        """Clip (when configured), then run the optimizer step as the policy says; ``step`` counts from 1."""
        if self.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(params, self.grad_clip)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            # One fused (foreach) norm over all gradients, as clip_grad_norm_ computes it: not a kernel per tensor.
            norm = nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self._first_bad.device)
        finite = torch.isfinite(norm)
        if self.policy == "skip":
            if not bool(finite):  # the one host sync per step that skipping costs
                self.skipped += 1
                log.warning("step %d: the gradient norm is %s; its update is skipped (train.nonfinite=skip, %d so "
                            "far)", step, float(norm), self.skipped)  # fmt: skip
                return
        else:
            self._first_bad = torch.where(finite | (self._first_bad >= 0), self._first_bad, step)
        optimizer.step()

    def check(self, step: int) -> None:
        """After each optimizer step: reads the device only at steps where the loop syncs anyway."""
        if step == self.last_step or any(step % every == 0 for every in self.check_every):
            self.raise_if_bad()

    def raise_if_bad(self) -> None:
        if self.policy != "stop":
            return
        bad = int(self._first_bad.item())
        if bad < 0:
            return
        good = [step for step in candidate_steps(self.checkpoints) if step < bad]
        last = str(self.checkpoints / state_name(good[0])) if good else "none (no checkpoint before that step)"
        raise NonfiniteError(
            f"The gradient norm at step {bad} is not finite (inf or nan): the loss diverged. The last good "
            f"checkpoint is {last}. Lower train.lr, set train.grad_clip, or set train.nonfinite=skip to skip such "
            "steps; a rerun resumes from that checkpoint."
        )
