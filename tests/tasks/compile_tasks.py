"""The shapes task compiled in place with a backend that takes ``task_options.eval_compile_seconds`` to compile the
first graph it is given under ``no_grad`` in eval mode (the evaluation's, not the settle step's at the first forward):
a slow compilation long after start-up, as inductor's cold cache gave one (#24.12). The training graphs compile at
once.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from service.tasks import shapes
from service.tasks.base import Task, TaskSpec


def slow_eval_compile(spec: TaskSpec) -> Task:
    seconds = float(spec.option("eval_compile_seconds", 8.0))
    options = {key: value for key, value in spec.options.items() if key != "eval_compile_seconds"}
    task = shapes.build(TaskSpec(seed=spec.seed, options=options))
    slept = []

    def backend(graph: Any, example_inputs: Any) -> Any:
        if not torch.is_grad_enabled() and not task.model.training and not slept:  # not the settle step's
            slept.append(seconds)
            print(f"slow eval compilation begins: {seconds} s", file=sys.stderr, flush=True)
            time.sleep(seconds)
        return graph.forward

    task.model.compile(backend=backend)  # in place: the evaluation runs the compiled module too
    return task
