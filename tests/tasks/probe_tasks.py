"""Test tasks that record what the training loop really fed the model (no torch.distributed here).

``recording_shapes``: shapes-segmentation whose *training* set appends every index it is asked for to
``task_options.record_dir/fetch-rank{RANK}.txt``, one per line, in the order the DataLoader fetched them
(``data.num_workers=0``: no read-ahead in other processes). The eval set is left alone.

``recording_draws``: shapes-segmentation whose model appends one ``torch.rand(4)`` per training forward to
``task_options.record_dir/draws-rank{RANK}.txt``: the per-step, per-rank RNG stream the loop seeds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from service.tasks import shapes
from service.tasks.base import Task, TaskSpec


class RecordingDataset(Dataset):
    def __init__(self, inner: Dataset, path: Path) -> None:
        self.inner = inner
        self.path = path

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int):  # noqa: ANN204
        with open(self.path, "a") as file:
            file.write(f"{int(index)}\n")
        return self.inner[index]


def recording_shapes(spec: TaskSpec) -> Task:
    options = {key: value for key, value in spec.options.items() if key != "record_dir"}
    task = shapes.build(TaskSpec(seed=spec.seed, options=options))
    directory = Path(str(spec.option("record_dir", ".")))
    directory.mkdir(parents=True, exist_ok=True)
    recorder = RecordingDataset(task.train_set, directory / f"fetch-rank{os.environ.get('RANK', '0')}.txt")
    return Task(model=task.model, train_set=recorder, eval_set=task.eval_set, loss_fn=task.loss_fn,
                metric_fn=task.metric_fn, metric_name=task.metric_name)  # fmt: skip


class DrawRecorder(nn.Module):
    """Draws ``torch.rand(4)`` first thing in each training forward and appends it, as JSON, to ``path``."""

    def __init__(self, inner: nn.Module, path: Path) -> None:
        super().__init__()
        self.inner = inner
        self.path = path

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            draw = torch.rand(4).tolist()
            with open(self.path, "a") as file:
                file.write(json.dumps(draw) + "\n")
        return self.inner(x)


def recording_draws(spec: TaskSpec) -> Task:
    """shapes-segmentation whose model records one random draw per training forward to
    ``task_options.record_dir/draws-rank{RANK}.txt``: what the step's RNG seed gives each rank."""
    options = {key: value for key, value in spec.options.items() if key != "record_dir"}
    task = shapes.build(TaskSpec(seed=spec.seed, options=options))
    directory = Path(str(spec.option("record_dir", ".")))
    directory.mkdir(parents=True, exist_ok=True)
    model = DrawRecorder(task.model, directory / f"draws-rank{os.environ.get('RANK', '0')}.txt")
    return Task(model=model, train_set=task.train_set, eval_set=task.eval_set, loss_fn=task.loss_fn,
                metric_fn=task.metric_fn, metric_name=task.metric_name)  # fmt: skip
