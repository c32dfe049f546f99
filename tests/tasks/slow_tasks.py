"""The shapes task with a model that sleeps in each training forward, so tests can stop a run mid-epoch.

The sleep changes no number: a slow run trains bit for bit like a fast one.
``task_options.dropout`` puts dropout on the input, so resume tests also
prove that the step's randomness replays exactly. ``task_options.long_step_at``
(a training forward count, from 1) makes that one forward sleep
``task_options.long_step_seconds`` (5 s) on the ranks in ``task_options.long_step_ranks``
(all by default), and prints ``long step begins`` to stderr as it starts.
``task_options.sleep_while`` (a path) keeps that sleep only while the path exists: a test slows a run down until
its event has been seen, then removes the file and lets the rest of the run go at full speed (the same
command, so the same config, either way).
``task_options.slow_state_seconds`` makes rank 0's first ``state_dict()`` after training began (its
checkpoint's) sleep that long, printing ``slow state_dict begins`` to stderr: a slow save, without a large state.
(Every rank calls ``state_dict()`` for the summary's digest; only ``RANK`` 0's sleeps.)
``task_options.tokens_per_sample`` gives the task a ``tokens_fn`` counting that many per sample.
``task_options.slow_rank`` makes one rank a straggler: the worker whose ``RANK`` (as torchrun
sets it; a test task may read it) equals it sleeps ``task_options.slow_rank_sleep`` seconds more
per training micro-step (the monitoring tests).
``task_options.item_sleep`` makes each training sample's ``__getitem__`` sleep that long (known data wait, with
``data.num_workers=0``); ``task_options.stall_seconds`` makes the ``task_options.stall_at``-th training
``__getitem__`` (from 1) of ``RANK`` ``task_options.stall_rank`` (1) sleep that long, once: a one-off data stall;
``task_options.linger_seconds`` makes ``RANK`` ``task_options.linger_rank`` (0) of a
first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) stay that long after its ``main`` has returned or raised, before the
process exits (a non-daemon thread): a known delay before its agent can restart the group (the goodput tests).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from torch import Tensor, nn
from torch.utils.data import Dataset

from service.tasks import shapes
from service.tasks.base import Task, TaskSpec


class Sleepy(nn.Module):
    def __init__(self, inner: nn.Module, seconds: float, dropout: float, long_step_at: int = 0,
                 long_step_seconds: float = 5.0, sleep_while: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.inner = inner
        self.seconds = seconds
        self.sleep_while = sleep_while
        self.dropout = nn.Dropout(dropout)
        self.long_step_at = long_step_at
        self.long_step_seconds = long_step_seconds
        self.forwards = 0
        self.slow_state_seconds = 0.0
        self._register_state_dict_hook(Sleepy._slow_state)

    @staticmethod
    def _slow_state(module: Sleepy, state: dict, prefix: str, local_metadata: dict) -> None:
        if module.slow_state_seconds and module.forwards:
            seconds, module.slow_state_seconds = module.slow_state_seconds, 0.0
            print(f"slow state_dict begins: {seconds} s", file=sys.stderr, flush=True)
            time.sleep(seconds)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.forwards += 1
            if self.forwards == self.long_step_at:
                print(f"long step begins: {self.long_step_seconds} s", file=sys.stderr, flush=True)
                time.sleep(self.long_step_seconds)
        if self.training and self.seconds and (self.sleep_while is None or os.path.exists(self.sleep_while)):
            time.sleep(self.seconds)
        return self.inner(self.dropout(x))


class SlowItems(Dataset):
    def __init__(self, inner: Dataset, seconds: float, stall_at: int = 0, stall_seconds: float = 0.0) -> None:
        self.inner, self.seconds = inner, seconds
        self.stall_at, self.stall_seconds, self.reads = stall_at, stall_seconds, 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> object:
        self.reads += 1
        if self.reads == self.stall_at:
            print(f"data stall begins: {self.stall_seconds} s", file=sys.stderr, flush=True)
            time.sleep(self.stall_seconds)
        time.sleep(self.seconds)
        return self.inner[index]


def linger_at_exit(seconds: float) -> None:
    """Keep this process alive ``seconds`` after the main thread has finished (the interpreter joins us), then
    leave at once as ``python -m service`` does without us: 1 after an uncaught exception, else 0."""

    def wait() -> None:
        while threading.main_thread().is_alive():
            time.sleep(0.01)
        print(f"lingering {seconds} s before exit", file=sys.stderr, flush=True)
        time.sleep(seconds)
        sys.stderr.flush()
        os._exit(1 if hasattr(sys, "last_value") else 0)

    threading.Thread(target=wait, name="linger", daemon=False).start()


def slow_shapes(spec: TaskSpec) -> Task:
    """shapes-segmentation, plus ``task_options.sleep`` seconds per training micro-step."""
    own = ("sleep", "dropout", "long_step_at", "long_step_seconds", "long_step_ranks", "tokens_per_sample",
           "slow_rank", "slow_rank_sleep", "slow_state_seconds", "item_sleep", "linger_seconds",
           "linger_rank", "stall_at", "stall_seconds", "stall_rank", "sleep_while")  # fmt: skip
    options = {key: value for key, value in spec.options.items() if key not in own}
    task = shapes.build(TaskSpec(seed=spec.seed, options=options))
    ranks = spec.option("long_step_ranks", None)
    long_step_at = int(spec.option("long_step_at", 0))
    if ranks is not None and int(os.environ.get("RANK", "0")) not in [int(rank) for rank in ranks]:
        long_step_at = 0
    seconds = float(spec.option("sleep", 0.05))
    slow_rank = spec.option("slow_rank", None)
    if slow_rank is not None and os.environ.get("RANK") == str(int(slow_rank)):
        seconds += float(spec.option("slow_rank_sleep", 0.0))
    model = Sleepy(task.model, seconds, float(spec.option("dropout", 0.0)),
                   long_step_at, float(spec.option("long_step_seconds", 5.0)),
                   spec.option("sleep_while", None))  # fmt: skip
    if os.environ.get("RANK", "0") == "0":
        model.slow_state_seconds = float(spec.option("slow_state_seconds", 0.0))
    per_sample = int(spec.option("tokens_per_sample", 0))
    item_sleep = float(spec.option("item_sleep", 0.0))
    stall_seconds = float(spec.option("stall_seconds", 0.0))
    stalls = os.environ.get("RANK", "0") == str(int(spec.option("stall_rank", 1)))
    stall_at = int(spec.option("stall_at", 0)) if stall_seconds and stalls else 0
    slow_items = item_sleep or stall_at
    train_set = SlowItems(task.train_set, item_sleep, stall_at, stall_seconds) if slow_items else task.train_set
    linger = float(spec.option("linger_seconds", 0.0))
    lingers = os.environ.get("RANK", "0") == str(int(spec.option("linger_rank", 0)))
    if linger and lingers and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        linger_at_exit(linger)
    return Task(model=model, train_set=train_set, eval_set=task.eval_set, loss_fn=task.loss_fn,
                metric_fn=task.metric_fn, metric_name=task.metric_name,
                tokens_fn=(lambda inputs: len(inputs) * per_sample) if per_sample else None)  # fmt: skip
