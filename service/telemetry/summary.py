"""The run summary rank 0 writes at the end, and the model digest that proves determinism."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def model_digest(state_dicts: Iterable[Mapping[str, torch.Tensor]]) -> str:
    """summary.json's ``model_digest``: sha256 over the tensors of each state dict in turn, in key order, as the
    bytes of contiguous CPU tensors."""
    digest = hashlib.sha256()
    for state_dict in state_dicts:
        for tensor in state_dict.values():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def strict(value: Any) -> Any:
    """``value`` as strict JSON takes it: every non-finite float (a logged nan or inf) becomes None, at any depth;
    the log line keeps the number itself."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def summary_json(summary: Mapping[str, Any]) -> str:
    """``summary.json``'s text: strict JSON (no NaN or Infinity, which JSON has not), sorted keys."""
    return json.dumps(strict(summary), indent=2, sort_keys=True, allow_nan=False) + "\n"


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
                      self.path, json.dumps(strict(summary), sort_keys=True, allow_nan=False))  # fmt: skip
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(summary_json(summary))
        os.replace(partial, self.path)
