"""What Accelerate and Fabric give a script's loop, on a :class:`service.Session` (its base class here).

- precision per ``train.amp``: ``with s.autocast(): loss = ...``, ``s.backward(loss)`` (scaled under fp16), and
  ``s.step(optimizer)`` (unscale, optional clipping, the non-finite guard of ``train.nonfinite``, the optimizer's
  step; under fp16 the :class:`~torch.amp.GradScaler`'s step and update). The scaler is kept in every checkpoint
  by itself (the entry ``__scaler__``), so a resumed fp16 run scales exactly as the uninterrupted one;
- gradient accumulation per ``train.grad_accum``: ``for mb in s.micro_batches(batch):`` splits one step's batch
  into that many equal parts, DDP's ``no_sync`` on all but the last; ``s.backward`` divides the loss by their number;
- evaluation: ``s.eval_batches(dataset, batch_size)`` (each rank a contiguous shard, every sample once, no padding,
  on the device), ``s.sum(x)``, ``s.mean(x, weight=n)`` and ``s.gather(x)`` across the ranks; an ``s.log`` outside
  a step is an evaluation's line at the step where it was made, and ``summary.json`` keeps it (``eval_metrics``);
- coordination: ``s.barrier()``, ``with s.main_first():``, ``s.print(...)`` (rank 0's), ``s.log_level``;
- ``for i in s.steps(n):`` a loop with no dataset (one optimizer step per yield, the same step boundary) and
  ``s.global_step``.

A setting these calls apply (``train.amp`` fp16/bf16, ``train.grad_accum`` > 1, ``train.nonfinite=skip``) is refused
at the end of the first step when the script used none of the calls that apply it: no setting is silently dropped.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from service.data.batches import to_device
from service.data.feeds import Fed, FeedError, is_stream
from service.data.sampler import MicroBatch, StepPlan
from service.state.checkpoint_io import load_tensors
from service.world.distributed import all_gather_bytes, barrier, sum_across

log = logging.getLogger("service.loop.train")

SCALER = "__scaler__"  # the fp16 gradient scaler's entry among the kept objects (no script names one so)
# A non-finite step's advice for a session: what a session takes (train.lr and train.grad_clip it refuses).
NONFINITE_FIX = ("Lower the optimizer's learning rate, pass s.step(optimizer, max_norm=...) to clip, or set "
                 "train.nonfinite=skip to skip such steps")  # fmt: skip


class ToolError(ValueError):
    """A session tool called with what it cannot take; the message names the call and the fix."""


class CountFeed:
    """``s.steps(n)``'s data: ``n`` steps of nothing but their index, one "sample" a step, resumable by its cursor."""

    stream = False

    def __init__(self, count: int) -> None:
        self.count = count

    @property
    def global_batch(self) -> int:
        return 1

    def signature(self) -> tuple[object, ...]:
        return "steps", self.count

    def steps_in_epoch(self, cursor: int = 0) -> int:
        return max(0, self.count - cursor)

    def epoch_done(self, cursor: int) -> bool:
        return cursor >= self.count

    def steps(self, epoch: int, cursor: int) -> Iterator[Fed]:
        for index in range(cursor, self.count):
            yield Fed(StepPlan(epoch=epoch, start=index, size=1, micro=(MicroBatch((), 1.0, 1),)), [index])

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any) -> None:
        return None


def split_batch(batch: Any, parts: int, call: str = "s.micro_batches") -> list[Any]:
    """``batch`` (tensors in dicts, lists, tuples) cut into ``parts`` equal parts along the first dimension."""
    if isinstance(batch, Tensor):
        size = batch.shape[0] if batch.dim() else 0
        if size == 0 or size % parts:
            raise ToolError(f"{call}(batch): a tensor of shape {tuple(batch.shape)} does not split into "
                            f"train.grad_accum={parts} equal micro-batches; pass s.batches a batch_size that is a "
                            f"multiple of {parts} (batch_size is the step's samples per rank).")  # fmt: skip
        return list(batch.split(size // parts))
    if isinstance(batch, Mapping):
        split = {key: split_batch(value, parts, call) for key, value in batch.items()}
        return [type(batch)({key: value[index] for key, value in split.items()}) for index in range(parts)]  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)) and batch:
        columns = [split_batch(value, parts, call) for value in batch]
        rebuild: Callable[[list[Any]], Any] = (lambda items: type(batch)(*items)) if hasattr(batch, "_fields") else (
            lambda items: type(batch)(items))  # fmt: skip
        return [rebuild([column[index] for column in columns]) for index in range(parts)]
    raise ToolError(f"{call}(batch) got a {type(batch).__name__} inside the batch; it splits tensors in dicts, lists "
                    "and tuples. Collate to tensors (s.batches' collate_fn), or split the step yourself.")  # fmt: skip


def _numbers(x: Any, call: str) -> tuple[list[float], Callable[[list[float]], Any]]:
    """``x`` (a number or a tensor) as host floats, and how to build the same kind of value from such floats."""
    if isinstance(x, Tensor):
        shape, device = x.shape, x.device
        dtype = x.dtype if x.is_floating_point() else torch.float64
        values = x.detach().to("cpu", torch.float64).reshape(-1).tolist()
        return values, lambda out: torch.tensor(out, dtype=torch.float64).to(dtype).reshape(shape).to(device)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return [float(x)], lambda out: out[0]
    raise ToolError(f"{call}({type(x).__name__}): it combines numbers and tensors across the ranks; pass a number, "
                    "a tensor, or e.g. torch.tensor(values).")  # fmt: skip


class SessionTools:
    """The calls above, on a session whose runtime is ``self._rt`` (mixed into :class:`service.Session`)."""

    _precision: Any = None
    _guard: Any = None
    _micro = 1  # inside s.micro_batches: the number of micro-batches s.backward divides a loss by
    _used: frozenset[str] | set[str] = frozenset()  # the tools the script called (the first step checks them)
    _checked = False
    _rt: Any
    rank: int
    world_size: int
    device: Any
    config: Any

    def _tools_open(self) -> None:
        """At start: the precision of ``train.amp``; its scaler kept (restored now on a resume)."""
        from service.model.precision import Precision

        rt = self._rt
        self._used = set()
        rt.resize_advice = ("pass s.batches a batch_size scaled by the change of s.world_size to keep it constant "
                            "across resizes")  # fmt: skip
        self._precision = Precision.for_job(rt.config.train.amp, rt.device)
        if self._precision.scaler is not None:
            rt.kept.keep({SCALER: self._precision}, False, "s.backward")

    def _use(self, name: str) -> None:
        if isinstance(self._used, set):
            self._used.add(name)

    # ------------------------------------------------------------------ precision
    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast per ``train.amp``: bf16 (``auto`` on CUDA), fp16, or nothing (``off``, ``auto`` on
        CPU). ``with s.autocast(): loss = loss_fn(model(x), y)``; then ``s.backward(loss)``."""
        self._rt  # noqa: B018 (started)
        self._use("autocast")
        return self._precision.autocast()

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` as ``train.amp`` wants it: multiplied by the fp16 gradient scaler's scale, and inside
        ``s.micro_batches`` divided by their number (the step's gradient is then the mean over its micro-batches,
        as one unaccumulated batch gives). Then ``s.step(optimizer)``."""
        self._rt  # noqa: B018
        self._use("backward")
        self._precision.backward(loss / self._micro if self._micro != 1 else loss)

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> bool:
        """The optimizer's step after ``s.backward``: the gradients unscaled (fp16), clipped to ``max_norm`` when
        given, checked per ``train.nonfinite`` (``stop``: the run fails naming the first non-finite step, no
        checkpoint of it; ``skip``: no update, counted in ``summary.json``'s ``nonfinite_steps``; under fp16 the
        scaler skips an overflowing step and lowers its scale), then ``optimizer.step()`` and the scaler's update.
        Call ``optimizer.zero_grad()`` yourself. One call per optimizer per step; True when it stepped. Under fp16
        each call updates the scaler's scale, so with two optimizers run each one's ``s.backward`` and ``s.step``
        in turn (DCGAN's order), not both backwards first."""
        from service.model.nonfinite import NonfiniteGuard

        rt = self._rt
        self._use("step")
        if self._guard is None:
            self._guard = NonfiniteGuard.for_job(rt.config, rt.device, rt.total_steps, self._precision)
            self._guard.fix = NONFINITE_FIX
            rt.nonfinite = self._guard  # summary.json counts its skips; no checkpoint of a non-finite step
        guard = self._guard
        guard.grad_clip = max_norm
        skipped = guard.skipped
        step = rt.state.global_step + (1 if rt.in_flight is not None else 0)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        guard.step(params, optimizer, step)
        guard.check(step)
        return guard.skipped == skipped

    # ------------------------------------------------------------------ accumulation
    def micro_batches(self, batch: Any) -> Iterator[Any]:
        """The step's ``batch`` in ``train.grad_accum`` equal parts (along the first dimension of each tensor),
        every model of ``s.model`` in DDP's ``no_sync`` for all but the last, so the gradients are all-reduced once
        per step. ``s.backward`` divides each part's loss by their number. One ``s.batches`` step stays one
        optimizer step: ``s.batches(dataset, batch_size)``'s batch_size is the step's samples per rank, a multiple
        of ``train.grad_accum``."""
        rt = self._rt
        self._use("micro_batches")
        count = rt.config.train.grad_accum
        parts = split_batch(batch, count) if count > 1 else [batch]
        models = [model for model in rt.models if isinstance(model, DistributedDataParallel)]
        for index, part in enumerate(parts):
            with contextlib.ExitStack() as stack:
                if index < count - 1:
                    for model in models:
                        stack.enter_context(model.no_sync())
                self._micro = count
                try:
                    yield part
                finally:
                    self._micro = 1

    # ------------------------------------------------------------------ evaluation
    def eval_batches(self, dataset: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None
                     ) -> Iterator[Any]:  # fmt: skip
        """This rank's shard of an evaluation set, in batches of ``batch_size``, on the device: a map-style
        dataset's contiguous share (rank r: samples ``r*n//world`` to ``(r+1)*n//world``), so every sample is seen
        once over the world, with no padding duplicates (shards may differ by one sample; the last batch may be
        short); ``s.gather`` of per-sample results gives them in the dataset's order. A stream: every
        world-size-th item from this rank's. Combine the ranks' numbers with ``s.sum`` / ``s.mean(x, weight=n)``."""
        from torch.utils.data import default_collate

        rt = self._rt
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise FeedError(f"s.eval_batches(dataset, batch_size={batch_size!r}): batch_size is the samples per "
                            "rank and batch, a whole number of at least 1.")  # fmt: skip
        collate = collate_fn or default_collate
        if is_stream(dataset):
            import itertools

            items: Iterator[Any] = itertools.islice(iter(dataset), self.rank, None, self.world_size)
        elif callable(getattr(dataset, "__len__", None)) and callable(getattr(dataset, "__getitem__", None)):
            length = len(dataset)
            start, end = self.rank * length // self.world_size, (self.rank + 1) * length // self.world_size
            items = (dataset[index] for index in range(start, end))
        else:
            raise FeedError(f"s.eval_batches got a {type(dataset).__name__}, which is neither a map-style dataset "
                            "(__len__ and __getitem__) nor an iterable one; pass a Dataset, a list, or a "
                            "stream.")  # fmt: skip
        chunk: list[Any] = []
        for item in items:
            chunk.append(item)
            if len(chunk) == batch_size:
                yield to_device(collate(chunk), rt.device)
                chunk = []
        if chunk:
            yield to_device(collate(chunk), rt.device)

    def sum(self, x: Any) -> Any:
        """``x`` (a number or a tensor of any shape) summed over the ranks, the same kind of value back (a tensor on
        its device, in its dtype); in float64 on the host. A collective: every rank calls it."""
        values, rebuild = _numbers(x, "s.sum")
        return rebuild(self._world_sum(values, "s.sum"))

    def mean(self, x: Any, weight: float | int | Tensor | None = None) -> Any:
        """``x`` averaged over the ranks; with ``weight`` (e.g. this rank's sample count), weighted: each rank's mean
        and count give the whole set's mean exactly as one process would. A collective: every rank calls it."""
        values, rebuild = _numbers(x, "s.mean")
        own = 1.0 if weight is None else sum(_numbers(weight, "s.mean(x, weight=...)")[0])
        total = self._world_sum([*(value * own for value in values), own], "s.mean")
        count = total[-1]
        if count == 0:
            raise ToolError(
                "s.mean(x, weight=...): the weights sum to 0 over the ranks; pass each rank's sample count."
            )
        return rebuild([value / count for value in total[:-1]])

    def gather(self, x: Any) -> Tensor:
        """Every rank's ``x`` (a tensor or a number) joined along the first dimension in rank order, on this device
        (a 0-d tensor or a number counts as one row); shards of different lengths are fine (``s.eval_batches``). A
        collective: every rank calls it."""
        rt = self._rt
        tensor = x.detach() if isinstance(x, Tensor) else torch.as_tensor(x)
        buffer = io.BytesIO()
        torch.save(tensor.to("cpu").reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1), buffer)
        payloads = all_gather_bytes(buffer.getvalue(), rt.control, self.world_size)
        parts = [load_tensors(payload, f"rank {rank}'s s.gather") for rank, payload in enumerate(payloads)]
        return torch.cat(parts).to(tensor.device)

    def _world_sum(self, values: Sequence[float], call: str) -> list[float]:
        rt = self._rt
        size = sum_across(rt.control)([float(len(values))])[0]
        if size != len(values) * self.world_size:
            raise ToolError(f"{call}(x): the ranks passed values of different sizes; pass each rank the same shape "
                            "(a per-rank count goes to s.gather).")  # fmt: skip
        return sum_across(rt.control)(values)

    def log(self, **scalars: Any) -> None:
        """Scalars (numbers or 0-d tensors) for rank 0's world-mean log line, TensorBoard and Prometheus; a name in
        ``checkpoint.best.metric`` ranks the checkpoints. Inside a step they join the step's log window. Outside one
        (an evaluation after an epoch's batches, before the first step) they are an evaluation's line at the step
        where they were made, their world mean now, kept in ``summary.json`` (``eval_metrics``): a collective then,
        so every rank calls it with the same names."""
        rt = self._rt
        if rt.in_flight is not None or not scalars:
            rt.log(scalars, "s.log")
            return
        from service.loop.window import scalar
        from service.telemetry.metrics import EvalReport

        own = {name: float(scalar(name, value, "s.log")) for name, value in scalars.items()}
        means = dict(zip(own, self._world_sum(list(own.values()), "s.log"), strict=True))
        means = {name: value / self.world_size for name, value in means.items()}
        report = EvalReport(epoch=rt.state.epoch, global_step=rt.state.global_step, metrics=means,
                            metric_name=next(iter(means)))  # fmt: skip
        rt.evaluated.update(means)
        rt.roles.sink.on_eval(report)
        if rt.config.checkpoint.best is not None and rt.feed is not None:
            rt.gather_own()
            rt.roles.checkpointer.on_eval(rt.state.global_step, means, rt.checkpoint_state)

    # ------------------------------------------------------------------ coordination
    def barrier(self) -> None:
        """Wait until every rank reaches this call (on the control group: host memory, no device)."""
        barrier(self._rt.control)

    def main_first(self) -> contextlib.AbstractContextManager:
        """``with s.main_first():`` rank 0 runs the block first (a download, a cache), then the other ranks do."""
        rt = self._rt
        return rt.roles.console.first(lambda: barrier(rt.control))

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (flushed); the other ranks print nothing."""
        self._rt.roles.console.print(*args, **kwargs)

    @property
    def log_level(self) -> int:
        """The level the service logs at on this rank: INFO on rank 0 (every rank with ``logging.all_ranks``),
        WARNING elsewhere. Quiet a script's own logger on the other ranks with ``logger.setLevel(s.log_level)``
        (or ``logging.basicConfig(level=s.log_level)``)."""
        from service.telemetry.logs import log_level

        return log_level(self.rank, self._rt.config.logging.all_ranks)

    # ------------------------------------------------------------------ steps without a dataset
    @property
    def global_step(self) -> int:
        """Optimizer steps done so far in the whole run: 0 on a fresh start, the resumed step after a resume
        (readable before the first step, e.g. a progress bar's ``initial``)."""
        return int(self._rt.state.global_step)

    def steps(self, n: int) -> Iterator[int]:
        """``for i in s.steps(n):`` a loop without a dataset (RL episodes, a generator's own sampling): ``n``
        optimizer steps in all (``train.max_steps`` may cap them; ``train.epochs`` plays no part), yielding the index
        of each (0 to n-1; a resume goes on from the step it stopped at), each through the same step boundary as
        ``s.batches``. A script's own RNG (a gymnasium env's ``np_random``) needs ``s.keep`` to resume exactly."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise FeedError(f"s.steps(n={n!r}): n is the run's number of optimizer steps, a whole number of at "
                            "least 1.")  # fmt: skip
        rt = self._rt
        if rt.feed is None and not rt.total_steps:
            max_steps = rt.config.train.max_steps
            rt.total_steps = min(n, max_steps) if max_steps else n
        return self._batches(CountFeed(n))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ settings that need a tool
    def _stepped(self, step: int) -> None:
        """The first step of this start is done: a setting only a tool applies, and no tool used, is refused."""
        if self._checked:
            return
        self._checked = True
        train, used, problems = self._rt.config.train, self._used, []
        if train.amp in ("fp16", "bf16") and not used & {"autocast", "backward"}:
            problems.append(f"train.amp={train.amp}: a session applies it through s.autocast() and s.backward(loss) "
                            "(then s.step(optimizer)); use them, or leave train.amp unset")  # fmt: skip
        if train.amp == "fp16" and "step" not in used and used & {"backward"}:
            problems.append("train.amp=fp16: its gradient scaler steps the optimizer: call s.step(optimizer) instead "
                            "of optimizer.step()")  # fmt: skip
        if train.grad_accum > 1 and "micro_batches" not in used:
            problems.append(f"train.grad_accum={train.grad_accum}: a session accumulates through "
                            "`for mb in s.micro_batches(batch):`; use it, or leave train.grad_accum unset")  # fmt: skip
        if train.nonfinite == "skip" and "step" not in used:
            problems.append("train.nonfinite=skip: a session applies it in s.step(optimizer) (after s.backward); "
                            "use it, or leave train.nonfinite unset")  # fmt: skip
        if problems:
            from service.config import ConfigError

            log.error("%s", ConfigError(problems, "The job config, for this session's script,"))
            raise SystemExit(2)
