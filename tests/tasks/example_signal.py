"""An example task as it is, whose rank 1 sends itself SIGTERM while it fetches its samples of step K.

A preemption notice that reaches one process at a step the test fixes, however
fast the example trains: a test that waits for a log line and then signals can
lag a whole run of 25 ms steps behind on a loaded machine. Only the first
attempt signals (``TORCHELASTIC_RESTART_COUNT`` 0); the samples are the
example's own, so the weights come out as the example's would.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any

from torch.utils.data import Dataset

from service.tasks.base import Task, TaskSpec
from service.tasks.loader import resolve


class SignalAtFetch(Dataset):
    def __init__(self, inner: Dataset, fetch: int) -> None:
        self.inner = inner
        self.fetch = fetch
        self.count = 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.count += 1
        if self.count == self.fetch:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.inner[index]


def build(spec: TaskSpec) -> Task:
    """``task_options``: the example's own, plus ``example`` (its ``module:function``) and ``signal_step`` (K)."""
    task = resolve(spec.option("example", ""))(spec)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.environ.get("RANK") != "1" or not first_attempt:
        return task
    per_step = int(spec.option("samples_per_rank_step", 1))  # batch_size x grad_accum
    fetch = (int(spec.option("signal_step", 3)) - 1) * per_step + 1  # the first sample of step K
    return dataclasses.replace(task, train_set=SignalAtFetch(task.train_set, fetch))
