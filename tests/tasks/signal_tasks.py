"""Test tasks that deliver a preemption signal at one exact point of a job, instead of at a lucky moment.

``sigterm_at_eval_start``: shapes-segmentation whose eval loader's worker processes, each the moment torch has
installed its DataLoader worker signal handlers (before the loader's ``worker_init_fn`` runs), send SIGTERM to
their own process group: the trainer rank and all its loader processes, as torchrun's agent signals a worker. An
eval loader's worker is one started while the model is in eval mode (``evaluate`` switches it first; the train
loader starts its workers in train mode). The trainer imports this module; its forked workers inherit the hook.
"""

from __future__ import annotations

import os
import signal

from torch.utils.data._utils import signal_handling

from service.tasks import shapes
from service.tasks.base import Task, TaskSpec


def sigterm_at_eval_start(spec: TaskSpec) -> Task:
    task = shapes.build(spec)
    model = task.model
    installed = signal_handling._set_worker_signal_handlers

    def install_then_signal(*args: object) -> None:
        installed(*args)
        if not model.training:
            os.killpg(0, signal.SIGTERM)

    signal_handling._set_worker_signal_handlers = install_then_signal
    return task
