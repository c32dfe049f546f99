"""Where a step's time goes: host timers around its collectives, with no device sync.

DDP is synchronous, so a slow rank makes the others wait in whichever
collective comes next: the gradient all-reduce in backward, DDP's buffer
broadcast at the start of forward, or SyncBatchNorm's all-reduces inside
forward and backward. A rank's *busy* time per step is its step time minus
the time it spent in those collectives; the straggler is the rank whose busy
time stands out from the job's median (``monitoring/rules.yml``). Timing only
the gradient all-reduce would miss the wait whenever SyncBatchNorm or the
buffer broadcast comes first, which is the default.

* :class:`AllreduceTimer` times the gradient all-reduce (a DDP comm hook).
* :class:`WaitClock` sums the other collectives of a step: DDP's pre-forward
  work (the buffer broadcast), timed by the service's DDP wrapper (two forward
  pre-hooks on another DDP model), and the CPU
  SyncBatchNorm's all-reduces (``service.model.syncbn``), timed around each call.

On NCCL the host does not block in a collective (the work is queued on a CUDA
stream), so these timers see only the launch: the score is as good as the
host's view there, which the docs say.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class AllreduceTimer:
    """A DDP comm hook: torch's default all-reduce, timed on the host without a sync.

    Each bucket's hook call is stamped, and a ``then`` callback on its future
    (on gloo it runs in gloo's thread when the all-reduce is done) stamps its
    completion. :meth:`take` returns the span from the step's first bucket
    launch to its last completion: DDP waits on the chained futures before
    backward returns, so the span is complete when the loop reads it. Buckets
    overlap with backward and with each other, so this is the wall time during
    which gradient communication was in flight, not a sum of bucket times. On
    NCCL a future completes when the work is enqueued on the stream, not when
    the GPU finishes it: timing the kernels would need CUDA events and a sync.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: float | None = None
        self._last: float | None = None
        self._group: Any = None  # the default group, once a hook call needed it

    def hook(self, process_group, bucket):  # noqa: ANN001, ANN201
        """torch's ``allreduce_hook`` (divide, all-reduce, take the value) with one timing callback.

        Unannotated on purpose: DDP refuses a hook whose annotations are not GradBucket and Future[Tensor].
        It calls the process group's ``allreduce`` directly, as DDP's built-in C++ hook does: going through
        ``dist.all_reduce`` and ``dist.get_world_size`` (their argument checks, in Python) doubled the hook's CPU,
        44 µs a step against 20 µs now over the built-in's (``bench/boundary.py``, docs/resume.md).
        """
        started = time.perf_counter()
        if self._first is None:  # set on the thread that runs backward, read by take() after backward returned
            self._first = started
        group = self._group if process_group is None else process_group
        if group is None:
            import torch.distributed as dist

            group = self._group = dist.group.WORLD  # None: the default group
            if group is None:
                raise RuntimeError("The all-reduce timing hook needs a process group: call it from DDP, which has one.")
        tensor = bucket.buffer()
        tensor.div_(group.size())
        return group.allreduce([tensor]).get_future().then(self._done)

    def _done(self, future: Any) -> Any:
        """A bucket's all-reduce is done (on gloo, in gloo's thread): stamp it, hand DDP the reduced tensor."""
        ended = time.perf_counter()
        with self._lock:
            self._last = ended if self._last is None else max(self._last, ended)
        return future.value()[0]

    def take(self) -> float | None:
        """Seconds of all-reduce since the last call, or None when no bucket was reduced (no_sync, no DDP)."""
        with self._lock:
            first, last, self._first, self._last = self._first, self._last, None, None
        return None if first is None or last is None else max(0.0, last - first)


class WaitClock:
    """Seconds blocked in the step's collectives other than the gradient all-reduce, summed until :meth:`take`.

    SyncBatchNorm's backward all-reduce runs on the autograd thread, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: float | None = None

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds = seconds if self._seconds is None else self._seconds + seconds

    def take(self) -> float | None:
        """Seconds since the last call, or None when nothing was timed (no DDP, no SyncBatchNorm)."""
        with self._lock:
            seconds, self._seconds = self._seconds, None
        return seconds


class _PreForwardTimer:
    """DDP's own work before the wrapped module's forward (the buffer broadcast), between two pre-hooks."""

    def __init__(self, clock: WaitClock) -> None:
        self.clock = clock
        self.entered: float | None = None

    def enter(self, module: Any, args: Any) -> None:
        self.entered = time.perf_counter()

    def leave(self, module: Any, args: Any) -> None:
        if self.entered is not None:
            self.clock.add(time.perf_counter() - self.entered)
            self.entered = None


def instrument(model: Any, allreduce: AllreduceTimer | None, waits: WaitClock | None) -> None:
    """Time a DDP model's collectives; a model that is not DDP (a world of 1) has none to time."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    if allreduce is not None:
        model.register_comm_hook(None, allreduce.hook)
    if waits is not None:
        timed_by_itself = getattr(model, "time_pre_forward", None)
        if callable(timed_by_itself):  # the service's DDP times its pre-forward itself: no hooks
            timed_by_itself(waits.add)
        else:
            pre_forward = _PreForwardTimer(waits)
            model.register_forward_pre_hook(pre_forward.enter)
            model.module.register_forward_pre_hook(pre_forward.leave)
        for module in model.modules():
            if hasattr(module, "wait_clock"):  # a layer that times its own collectives (model.syncbn)
                setattr(module, "wait_clock", waits)  # noqa: B010 (any module with that slot, not one class)
