"""The run summary rank 0 writes at the end, and the model digest that proves determinism."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def model_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors in key order, as the bytes of contiguous CPU tensors."""
    digest = hashlib.sha256()
    for tensor in state_dict.values():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class SummaryWriter:
    """Writes nothing: every rank but 0."""

    def write(self, summary: Mapping[str, Any]) -> None:
        return None

    def fence(self, vacant: Callable[[], bool]) -> None:
        """run_dir's lock was lost: write only while ``vacant()`` says no other job holds the directory."""


class JsonSummaryWriter(SummaryWriter):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.vacant: Callable[[], bool] | None = None

    def fence(self, vacant: Callable[[], bool]) -> None:
        self.vacant = vacant

    def write(self, summary: Mapping[str, Any]) -> None:
        if self.vacant is not None and not self.vacant():
            log.error("summary not written: %s belongs to the job that holds run_dir's lock now; this job's was %s",
                      self.path, json.dumps(summary, sort_keys=True))  # fmt: skip
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        os.replace(partial, self.path)
