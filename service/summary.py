"""The run summary rank 0 writes at the end, and the model digest that proves determinism."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from service.parallel import unwrap

if TYPE_CHECKING:  # the loop imports this module
    from service.metrics import EvalReport
    from service.train import Job, LoopState

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


def make_summary(job: Job, state: LoopState, report: EvalReport | None, seconds: float, trained: int,
                 status: str, error: str | None = None) -> dict[str, Any]:  # fmt: skip
    """What ``summary.json`` holds; ``samples_per_second`` counts what this start trained, not the samples before
    the resumed step."""
    return {
        "status": status,
        "stopped_at_step": state.global_step if status != "completed" else None,
        "error": error,
        "resumed_from": job.resumed.describe() if job.resumed else None,
        "task": job.config.task,
        "model_digest": model_digest(unwrap(job.model).state_dict()),
        "global_step": state.global_step,
        "total_steps": job.total_steps,
        "samples_seen": state.samples_seen,
        "epochs_completed": state.epochs_completed,
        "world_size": job.world.world_size,
        "global_batch_size": job.plan.global_batch,
        "grad_accum": job.plan.micro_steps,
        "restarts": job.world.restart_count,
        "nonfinite_steps": job.nonfinite.skipped,
        "final_loss": report.loss if report else None,
        "eval_metric": {"name": job.task.metric_name, "value": report.metric if report else None},
        "checkpoint": {
            "last": str(job.roles.checkpointer.last_path or "") or None,
            "failures": job.roles.checkpointer.failures,
        },
        "wall_seconds": round(seconds, 3),
        "samples_per_second": round(trained / seconds, 2) if seconds > 0 else None,
        "launcher": job.world.launcher,
        "scheduler": job.world.scheduler,
        "device": job.device.type,
    }
