"""How a batch becomes a loss to train on, and named per-sample values to evaluate: the task's side of a step.

A task gives either ``loss_fn`` (the service calls ``loss_fn(model(input),
target)`` on ``(input, target)`` pairs) or its own ``step_fn(model, batch)``.
:class:`TaskStep` turns both into one call, and checks what the task returns
at the first step, with errors that name the task and the fix; later steps
pay one attribute test for that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from service.config.errors import TaskInterfaceError, ddp_hint
from service.data.batches import BatchError, leading_size, require_tensors, tensors
from service.tasks.base import Task


def _floats(output: Any) -> Any:
    """A model's output in float32 for the loss, as the eval always computed it (autocast may give bf16)."""
    if isinstance(output, Tensor):
        return output.float() if output.is_floating_point() else output
    return output


class TaskStep:
    """The loss of a training batch and the per-sample eval values of an eval batch, for one task."""

    def __init__(self, task: Task, name: str) -> None:
        self.task = task
        self.name = name
        self.size_of: Callable[[Any], int] = task.batch_size_fn or leading_size
        self._first = True
        self.loss = self._checked_loss
        self._extras: dict[str, list[Any]] = {}  # the step's extra numbers, per micro-batch, until taken

    # ------------------------------------------------------------------ training
    def _loss(self, model: nn.Module, batch: Any) -> Any:
        task = self.task
        try:
            if task.step_fn is not None:
                return self._split(task.step_fn(model, batch))
            inputs, targets = self._pair(batch)
            output = model(inputs)
            if self._first and not tensors(output):
                raise TaskInterfaceError(
                    f"The model of task {self.name!r} returned {type(output).__name__} with no tensors in it, so "
                    "loss_fn has nothing to score. Return the output tensor(s) from forward, or give the task a "
                    "step_fn(model, batch) that computes the loss the way your training code does."
                )
            return task.loss_fn(output, targets)  # type: ignore[misc]
        except RuntimeError as exc:
            raise ddp_hint(exc) from exc

    def _split(self, result: Any) -> Any:
        """A step_fn's ``(loss, {name: value})``: the loss, with the numbers kept for the step's log line."""
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
            loss, extras = result
            for name, value in extras.items():
                self._extras.setdefault(str(name), []).append(value.detach() if isinstance(value, Tensor) else value)
            return loss
        return result

    def take_extras(self) -> dict[str, Any]:
        """The step's extra numbers (a step_fn's ``(loss, {name: value})``), each the mean over its micro-batches."""
        extras, self._extras = self._extras, {}
        return {name: values[0] if len(values) == 1 else sum(values) / len(values) for name, values in extras.items()}

    def _checked_loss(self, model: nn.Module, batch: Any) -> Tensor:
        """The first step's loss, checked; then :attr:`loss` is the plain call."""
        require_tensors(batch, self.name)
        loss = self._loss(model, batch)
        self.check_loss(loss)
        self._first = False
        self.loss = self._loss
        return loss

    def check_loss(self, loss: Any) -> None:
        source = "step_fn" if self.task.step_fn is not None else "loss_fn"
        fix = f"The {source} of task {self.name!r}"
        if isinstance(loss, tuple) or (isinstance(loss, list) and loss):
            raise TaskInterfaceError(
                f"{fix} returned a {type(loss).__name__} of {len(loss)} items; it must return the loss alone, a "
                "scalar tensor, or (loss, {name: number}) to log more numbers beside it. For a model that returns "
                "(logits, loss), return its loss: step_fn=lambda model, batch: model(batch['idx'], "
                "batch['targets'])[1]."
            )
        if not isinstance(loss, Tensor):
            attribute = " (a model output with .loss: return output.loss)" if hasattr(loss, "loss") else ""
            raise TaskInterfaceError(
                f"{fix} returned {type(loss).__name__}, not a tensor; it must return the batch's mean loss as a "
                f"scalar tensor{attribute}."
            )
        if loss.numel() != 1:
            raise TaskInterfaceError(
                f"{fix} returned a loss of shape {tuple(loss.shape)}, not a scalar: the service backpropagates "
                "the batch's mean loss. Use reduction='mean' (not 'none'), or return loss.mean()."
            )
        if not loss.requires_grad:
            raise TaskInterfaceError(
                f"{fix} returned a loss with no grad: it does not depend on the model's trainable parameters "
                "(computed under torch.no_grad(), detached with .detach() or .item(), or from inputs only). "
                "Compute it from the model's output inside the step, without no_grad."
            )

    def _pair(self, batch: Any) -> tuple[Any, Any]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise TaskInterfaceError(
            f"The task {self.name!r} has no step_fn, so its batches must be (input, target) pairs for "
            f"loss_fn(model(input), target); this batch is a {type(batch).__name__}"
            f"{f' of {len(batch)} items' if isinstance(batch, (tuple, list)) else ''}. Give the task a "
            "step_fn(model, batch) that calls the model the way your code does and returns the mean loss."
        )

    def count_tokens(self, micro: list[Any], reals: list[int]) -> int:
        """Tokens in one step's real samples, from the loader's host tensors; 0 without ``tokens_fn``.

        A micro-batch is all real samples or one filler (``real`` 0), which is skipped.
        """
        count = self.task.tokens_fn
        if count is None:
            return 0
        own = self.task.step_fn is not None
        return sum(int(count(batch if own else self._pair(batch)[0])) for batch, real in zip(micro, reals, strict=True)
                   if real)  # fmt: skip

    # ------------------------------------------------------------------ evaluation
    def metric_names(self, module: nn.Module, sample: Callable[[], Any], eval_size: int,
                     autocast: Callable[[], Any]) -> list[str]:  # fmt: skip
        """The eval values' names, the same on every rank: an ``eval_fn``'s from one eval sample, before training.

        Every rank must all-reduce the same values in the same order, even one
        whose eval shard is empty; the probe also checks ``eval_fn``'s contract
        before any step is spent.
        """
        task = self.task
        if task.eval_fn is None:
            return ["loss", *([task.metric_name] if task.metric_fn is not None else [])]  # type: ignore[list-item]
        if not eval_size:
            return []
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                sums, _ = self.eval_values(module, sample(), autocast)
        finally:
            module.train(was_training)
        return list(sums)

    def headline(self, names: list[str]) -> str:
        """The metric summary.json and ``ddp_train_eval_metric`` lead with: the task's, else the first but loss."""
        if self.task.metric_name in names:
            return self.task.metric_name
        return next((name for name in names if name != "loss"), "loss")

    def eval_values(self, module: nn.Module, batch: Any, autocast: Callable[[], Any]) -> tuple[dict[str, Tensor], int]:
        """This batch's per-sample values summed, by name, and its sample count (under ``no_grad``)."""
        task = self.task
        if task.eval_fn is not None:
            with autocast():
                values = task.eval_fn(module, batch)
            return self._eval_sums(values, batch)
        count = self._count(batch)
        if task.step_fn is not None:
            with autocast():
                loss = self._split(task.step_fn(module, batch))
            self._extras.clear()  # the training step's numbers only
            return {"loss": loss.double() * count}, count
        inputs, targets = self._pair(batch)
        with autocast():
            output = module(inputs)
        output = _floats(output)
        sums = {"loss": task.loss_fn(output, targets).double() * count}  # type: ignore[misc]
        if task.metric_fn is not None:
            sums[task.metric_name] = task.metric_fn(output, targets).double().sum()  # type: ignore[index]
        return sums, count

    def _count(self, batch: Any) -> int:
        try:
            return int(self.size_of(batch))
        except BatchError as exc:
            raise BatchError(f"Task {self.name!r}: {exc}") from None

    def _eval_sums(self, values: Any, batch: Any) -> tuple[dict[str, Tensor], int]:
        if not isinstance(values, Mapping) or not values:
            raise TaskInterfaceError(
                f"The eval_fn of task {self.name!r} returned {type(values).__name__}; it must return a non-empty "
                "mapping of names to per-sample values, e.g. {'loss': losses, 'accuracy': correct.float()}, each "
                "of shape (batch,)."
            )
        count = self._count(batch)
        sums = {}
        for name, value in values.items():
            if not isinstance(value, Tensor) or value.shape != (count,):
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise TaskInterfaceError(
                    f"The eval_fn of task {self.name!r} returned {name!r} of shape {shape} for a batch of {count} "
                    f"samples; each value must have shape ({count},), one number per sample (use "
                    "reduction='none' for losses), so that the service averages it over the whole eval set."
                )
            sums[str(name)] = value.double().sum()
        return sums, count
