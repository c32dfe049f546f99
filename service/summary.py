"""The run summary rank 0 writes at the end, and the model digest that proves determinism."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


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


class JsonSummaryWriter(SummaryWriter):
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, summary: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        os.replace(partial, self.path)
