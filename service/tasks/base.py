"""What a task hands the service: a model, two datasets, and how to get a loss (and eval numbers) from a batch.

A task knows nothing of processes, ranks or devices: no ``torch.distributed``
here. The service shards the data, wraps the model and moves tensors.

Two shapes of task, both public API (add fields, never rename):

- **pairs** (the original shape): datasets yield ``(input, target)``; the
  service calls ``loss_fn(model(input), target)`` and evaluates
  ``loss_fn`` and ``metric_fn``.
- **own step**: ``step_fn(model, batch)`` returns the batch's mean loss, calling
  the model as the user's code does (``model(idx, targets)[1]``,
  ``model(**batch).loss``). ``loss_fn``/``metric_fn`` are then optional.

Either shape may add ``collate_fn``, ``eval_fn``, ``optimizer_fn``,
``scheduler_fn`` and ``batch_size_fn``. A batch is any nesting of tensors in
dicts, lists, tuples, namedtuples and dataclasses; the service moves every
tensor to the device and passes anything else through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the job config passes to a task's build function."""

    seed: int
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def option(self, name: str, default: Any) -> Any:
        return self.options.get(name, default)


@dataclasses.dataclass(frozen=True)
class Task:
    """A built task.

    ``loss_fn(output, target)`` returns the mean loss over the batch;
    ``metric_fn(output, target)`` returns one score per sample (higher is better),
    which the service averages over the whole eval set across ranks.
    ``tokens_fn(inputs)``, when set, counts the tokens of a batch of real samples
    (on the host, from the loader's CPU tensors) for ``ddp_train_tokens_total``;
    ``inputs`` is the input part of a pair, or the whole batch with ``step_fn``.

    ``step_fn(model, batch) -> Tensor``: the batch's mean loss, a scalar with a
    grad. ``model`` is the DDP-wrapped module. The service still owns backward,
    ``no_sync`` on accumulation micro-steps, the weighting of uneven steps,
    clipping, AMP and the optimizer step.

    ``collate_fn(samples) -> batch``: the loaders' collate (padding, variable
    lengths, dict samples); torch's default collate otherwise.

    ``eval_fn(model, batch) -> Mapping[str, Tensor]``: named per-sample values,
    each of shape ``(batch,)``, run under ``no_grad`` on the task's own module
    (not the DDP wrapper). Each is averaged over the whole eval set across ranks,
    each sample once. Without it: ``loss`` (and ``metric_name`` from
    ``metric_fn`` for pairs).

    ``optimizer_fn(module) -> Optimizer`` gets the task's own module (on its
    device, not the DDP wrapper), so a model's own ``configure_optimizers``
    works; ``train.optimizer`` builds one otherwise. ``scheduler_fn(optimizer,
    total_steps) -> LRScheduler`` is stepped once per optimizer step
    (``ReduceLROnPlateau``: after each evaluation, on the eval ``loss``);
    ``train.lr_schedule`` otherwise.

    ``batch_size_fn(batch) -> int``: samples in a batch; by default the leading
    dimension of the batch's first tensor.

    ``state``: more objects to keep, by name (each with ``state_dict`` and
    ``load_state_dict``: a second model or optimizer, a hidden state, a stream's
    position): saved in every checkpoint and snapshot with the model, and loaded
    back on a resume, as a script's ``s.keep`` does.

    ``step_fn`` may return ``(loss, {name: number})``: the numbers (0-d tensors
    or floats) are logged beside the loss, as the world's mean at each log line.

    ``train_set`` may be an iterable dataset (a ``torch.utils.data.IterableDataset``
    or a Hugging Face ``datasets`` stream): each rank reads its own shard; see
    :class:`service.Session`'s ``batches``.
    """

    model: nn.Module
    train_set: Dataset
    eval_set: Dataset
    loss_fn: Callable[[Any, Any], Tensor] | None = None
    metric_fn: Callable[[Any, Any], Tensor] | None = None
    metric_name: str | None = None
    tokens_fn: Callable[[Any], int] | None = None
    step_fn: Callable[[nn.Module, Any], Tensor] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    eval_fn: Callable[[nn.Module, Any], Mapping[str, Tensor]] | None = None
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    scheduler_fn: Callable[[torch.optim.Optimizer, int], Any] | None = None
    batch_size_fn: Callable[[Any], int] | None = None
    state: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def problems(self) -> list[str]:
        """What is missing for the service to train and evaluate this task (empty when it can)."""
        found = []
        if not isinstance(self.model, nn.Module):
            found.append(f"model is a {type(self.model).__name__}, not a torch.nn.Module")
        if self.step_fn is None and self.loss_fn is None:
            found.append("it has neither step_fn (the batch's mean loss from the model) nor loss_fn "
                         "(loss_fn(model(input), target)); give one of them")  # fmt: skip
        if self.metric_fn is not None and not self.metric_name:
            found.append("metric_fn is set without metric_name; name the metric (e.g. metric_name='accuracy')")
        if self.metric_fn is not None and self.metric_name == "loss":
            found.append("metric_name is 'loss', the name of the eval loss itself; pick another name")
        if not isinstance(self.state, Mapping):
            found.append(f"state is a {type(self.state).__name__}; give a dict of names to objects with state_dict "
                         "and load_state_dict, e.g. state={'netD': netD, 'optD': optD}")  # fmt: skip
        else:
            for name, value in self.state.items():
                if not all(callable(getattr(value, method, None)) for method in ("state_dict", "load_state_dict")):
                    found.append(f"state[{name!r}] is a {type(value).__name__} without state_dict and "
                                 "load_state_dict; keep only objects that have both")  # fmt: skip
        for name in ("step_fn", "collate_fn", "eval_fn", "optimizer_fn", "scheduler_fn", "batch_size_fn",
                     "loss_fn", "metric_fn", "tokens_fn"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not callable(value):
                found.append(f"{name} is a {type(value).__name__}, not a function")
        return found
