"""Batches of any shape: collated with errors that name the fix, moved to the device, counted and cut.

A batch is any nesting of tensors in dicts, lists, tuples, namedtuples and
dataclasses. Every function here walks it the same way; anything that is not
a tensor or a container passes through untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate


class BatchError(TypeError):
    """A batch the service cannot collate, move or count; the message names the task's fix.

    Takes one string, so a DataLoader worker can re-raise it in the main process.
    """


def _map(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it, containers rebuilt as they were."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: _map(value, fn) for key, value in batch.items()}
        return items if type(batch) is dict else _rebuild_mapping(batch, items)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_map(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(value, fn) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: _map(getattr(batch, f.name), fn) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **fields)
    return batch


def _rebuild_mapping(batch: Mapping, items: dict[str, Any]) -> Any:
    try:
        return type(batch)(items)  # type: ignore[call-arg]  # OrderedDict, a BatchEncoding-like dict subclass
    except TypeError:
        return items


def tensors(batch: Any) -> list[Tensor]:
    """Every tensor in ``batch``, in the order :func:`_map` visits them."""
    found: list[Tensor] = []
    _map(batch, found.append)
    return found


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of ``batch`` on ``device``; fast for the common ``(input, target)`` pair of tensors."""
    if type(batch) in (tuple, list) and all(type(item) is Tensor for item in batch):
        return type(batch)(item.to(device, non_blocking=non_blocking) for item in batch)
    return _map(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def leading_size(batch: Any) -> int:
    """The default ``batch_size_fn``: the leading dimension of the batch's first tensor."""
    for tensor in tensors(batch):
        if tensor.dim():
            return int(tensor.shape[0])
    raise BatchError(
        f"A batch of type {type(batch).__name__} holds no tensor with a batch dimension, so the service cannot "
        "count its samples. Give the task a collate_fn that returns tensors, or a batch_size_fn(batch) -> int."
    )


def require_tensors(batch: Any, task: str) -> None:
    """At the first step: a batch with no tensor at all would reach the model on the host, unmoved."""
    if not tensors(batch):
        raise BatchError(
            f"The task {task!r} gave a batch of type {type(batch).__name__} that holds no tensors, so the service "
            "cannot move it to the device. Give the task a collate_fn(samples) that returns tensors (in a dict, "
            "tuple or list if you like)."
        )


def checked_collate(task: str) -> Callable[[list[Any]], Any]:
    """torch's default collate, whose failures on samples it cannot stack name the task's fix."""

    def collate(samples: list[Any]) -> Any:
        try:
            return default_collate(samples)
        except RuntimeError as exc:
            if "stack expects each tensor to be equal size" not in str(exc):
                raise
            raise BatchError(
                f"The samples of task {task!r} have unequal shapes ({exc}), so the default collate cannot stack "
                "them into one batch. Give the task a collate_fn(samples) that pads them (e.g. "
                "torch.nn.utils.rnn.pad_sequence) and returns the lengths or a mask with the batch."
            ) from None
        except TypeError as exc:
            raise BatchError(
                f"The samples of task {task!r} are {type(samples[0]).__name__} objects, which the default "
                f"collate cannot batch ({exc}). Give the task a collate_fn(samples) that builds the batch as "
                "tensors (in a dict, tuple or list if you like)."
            ) from None

    return collate
