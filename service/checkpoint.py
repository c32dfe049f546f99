"""Rank-0 checkpoints of the unwrapped model (``model.module.state_dict()``), and the null one.

Written to a temporary name and renamed, so a crash mid-save never leaves a
truncated file under a checkpoint's name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, Any]]


class Checkpointer:
    """Saves nothing: what every rank but 0 gets, and rank 0 when checkpoints are off."""

    def maybe_save(self, global_step: int, state: StateFn) -> Path | None:
        return None

    def save(self, global_step: int, state: StateFn) -> Path | None:
        return None


class Rank0Checkpointer(Checkpointer):
    def __init__(self, directory: Path, every_steps: int, keep: int) -> None:
        self.directory = directory
        self.every_steps = every_steps
        self.keep = keep

    def maybe_save(self, global_step: int, state: StateFn) -> Path | None:
        if global_step % self.every_steps:
            return None
        return self.save(global_step, state)

    def save(self, global_step: int, state: StateFn) -> Path | None:
        """Save once per step: the end-of-run save skips a step already saved."""
        path = self.directory / f"step-{global_step:08d}.pt"
        if path.exists():
            return path
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(state(), partial)
        os.replace(partial, path)
        log.info("checkpoint saved: %s", path)
        self._prune()
        return path

    def _prune(self) -> None:
        for old in list_checkpoints(self.directory)[: -self.keep]:
            old.unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (the zero-padded step sorts by name)."""
    return sorted(directory.glob("step-*.pt"))
