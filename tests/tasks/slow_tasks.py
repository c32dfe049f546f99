"""The shapes task with a model that sleeps in each training forward, so tests can stop a run mid-epoch.

The sleep changes no number: a slow run trains bit for bit like a fast one.
``task_options.dropout`` puts dropout on the input, so resume tests also
prove that the step's randomness replays exactly.
"""

from __future__ import annotations

import time

from torch import Tensor, nn

from service.tasks import shapes
from service.tasks.base import Task, TaskSpec


class Sleepy(nn.Module):
    def __init__(self, inner: nn.Module, seconds: float, dropout: float) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = seconds
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.seconds:
            time.sleep(self.seconds)
        return self.inner(self.dropout(x))


def slow_shapes(spec: TaskSpec) -> Task:
    """shapes-segmentation, plus ``task_options.sleep`` seconds per training micro-step."""
    options = {key: value for key, value in spec.options.items() if key not in ("sleep", "dropout")}
    task = shapes.build(TaskSpec(seed=spec.seed, options=options))
    model = Sleepy(task.model, float(spec.option("sleep", 0.05)), float(spec.option("dropout", 0.0)))
    return Task(model=model, train_set=task.train_set, eval_set=task.eval_set, loss_fn=task.loss_fn,
                metric_fn=task.metric_fn, metric_name=task.metric_name)  # fmt: skip
