"""``checkpoint.best``: which evaluated checkpoint is the best so far, kept apart from pruning.

The best one is a pointer, ``run_dir/checkpoints/best.json`` (step, metric,
mode, value, lineage), next to the ordinary checkpoint files of that step;
pruning skips the step it names. The pointer is replaced atomically (written
to a temporary name, fsynced, renamed) only once the step it names is on disk,
and the previous best is pruned only after that: a crash at any point leaves
the old best or the new one, never none. A resume reads it back, so a resumed
run compares against the best value of the run before it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.state.files import fsync_dir, read_small, write_synced
from service.state.names import state_name

BEST_NAME = "best.json"
_MAX_BYTES = 16 * 1024


class BestMetricError(ValueError):
    """``checkpoint.best.metric`` names no result the evaluation reports: bad input, found on every rank before
    training (exit 2, like an invalid config)."""

    exit_code = 2


class BestRecord(BaseModel):
    """What ``best.json`` says; checked like a manifest before it is used."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    step: int = Field(ge=0, lt=10**8)
    file: str
    metric: str
    mode: Literal["min", "max"]
    value: float
    lineage: str | None = None

    def describe(self) -> dict[str, object]:
        return {"step": self.step, "file": self.file, "metric": self.metric, "value": self.value}


@dataclasses.dataclass(frozen=True)
class BestRule:
    """``checkpoint.best``: the eval result to rank by and which way is better."""

    metric: str
    mode: str  # "min" or "max"

    def value_of(self, results: Mapping[str, float]) -> float:
        """The ranked value among an evaluation's results; :class:`BestMetricError` when there is none."""
        if not results:
            raise BestMetricError(
                f"checkpoint.best ranks by {self.metric!r}, but this task reports no evaluation (its eval set is "
                "empty). Give the task an eval set, or set checkpoint.best=null."
            )
        if self.metric not in results:
            raise BestMetricError(
                f"checkpoint.best.metric is {self.metric!r}, but the evaluation reports only "
                f"{', '.join(sorted(results))}. Set checkpoint.best.metric to one of those "
                f"(e.g. --set checkpoint.best.metric={sorted(results)[0]}), or checkpoint.best=null to turn it off."
            )
        return float(results[self.metric])

    def improves(self, value: float, best: BestRecord | None) -> bool:
        """Strictly better than ``best`` (anything finite beats none; nan never wins)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        return value < best.value if self.mode == "min" else value > best.value

    def record(self, step: int, value: float, lineage: str | None) -> BestRecord:
        return BestRecord(step=step, file=state_name(step), metric=self.metric, mode=self.mode,
                          value=value, lineage=lineage)  # fmt: skip


def read_best(directory: Path) -> BestRecord | None:
    """The pointer in ``directory``, or None when there is none; ``ValueError`` naming why it cannot be used."""
    try:
        raw = read_small(directory, BEST_NAME, _MAX_BYTES)
    except FileNotFoundError:
        return None
    if raw is None:
        raise ValueError(f"{directory / BEST_NAME} is larger than {_MAX_BYTES} bytes")
    try:
        record = BestRecord.model_validate(json.loads(raw))
    except (ValueError, ValidationError, RecursionError) as exc:
        raise ValueError(f"{directory / BEST_NAME} is not valid ({str(exc).splitlines()[0]})") from None
    if record.file != state_name(record.step):
        raise ValueError(f"{directory / BEST_NAME} names step {record.step} but file {record.file!r}")
    return record


def write_best(directory: Path, record: BestRecord) -> None:
    """Replace the pointer atomically: the old one stays until the new one is complete on disk. ``OSError``."""
    target = directory / BEST_NAME
    tmp = directory / f".{BEST_NAME}.{os.getpid()}.tmp"
    try:
        write_synced(tmp, lambda file: file.write(record.model_dump_json(indent=2).encode()))
        os.replace(tmp, target)
        fsync_dir(directory)
    finally:
        tmp.unlink(missing_ok=True)
