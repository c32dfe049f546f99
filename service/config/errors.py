"""Errors that come with the fix: the seed's in-place autograd error under DDP, DDP's buffer broadcast, and DDP's
reduction that never finished because the loss left parameters unused."""

from __future__ import annotations

from torch import Tensor

INPLACE_MARKER = "modified by an inplace operation"

INPLACE_HINT = (
    "Backward failed because a tensor it needs was changed in place. Under DDP the usual causes are:\n"
    "  1. two forward passes through a DDP-wrapped model with BatchNorm before one backward, while DDP "
    "broadcasts buffers at each forward: set `ddp.broadcast_buffers: false` (--set "
    "ddp.broadcast_buffers=false), or run both inputs through one forward;\n"
    "  2. an in-place operation on an activation that backward needs (x += ..., x.mul_(), "
    "ReLU(inplace=True) after an op that saves its output): use the out-of-place form.\n"
    "torch.autograd.set_detect_anomaly(True) names the forward operation."
)


class Refusal(SystemExit):
    """Bad input found before training: what a script keeps or feeds does not fit (the run it resumes kept other
    names, a stream saved at another world size, a stream with no length and no ``train.max_steps``).

    Mixed into an ordinary error (``class KeepError(TypeError, Refusal)``): ``except Exception`` catches it as
    before, and a process that does not catch it exits 2 with no traceback, as for a bad config. The loop logs
    its message on every rank (:meth:`service.loop.runtime.Runtime.fail`) and writes nothing: no checkpoint, and
    ``summary.json`` stays the last run's.
    """

    @property
    def code(self) -> int:  # type: ignore[override]  # what Python's exit reads of an uncaught SystemExit
        return 2


class TaskInterfaceError(TypeError):
    """What a task returned does not fit the contract of ``service.tasks.base.Task``; the message names the fix."""


class InplaceGradientError(RuntimeError):
    """Raised in place of torch's in-place RuntimeError, with the causes and the config switch."""


def backward(loss: Tensor) -> None:
    """``loss.backward()``, re-raising the in-place autograd error with a hint."""
    try:
        loss.backward()
    except RuntimeError as exc:
        if INPLACE_MARKER in str(exc):
            raise InplaceGradientError(f"{exc}\n\n{INPLACE_HINT}") from exc
        raise


SHARED_MEMORY_MARKER = "to a single memory location"

BUFFER_HINT = (
    "DDP broadcasts the model's buffers from rank 0 when it wraps the model and, with ddp.broadcast_buffers, "
    "before every forward; a buffer of this model is a view whose elements share memory (made with expand() "
    "or as a slice of another buffer, as positional tables often are), which that in-place broadcast cannot "
    "write. When the buffers are constant or computed alike on every rank (positional tables, masks; every "
    "rank builds the model from the same seed), set `ddp.broadcast_buffers: false` (--set "
    "ddp.broadcast_buffers=false): DDP then leaves buffers alone. Otherwise register a contiguous copy "
    "(`.clone()`)."
)


class BufferBroadcastError(RuntimeError):
    """Raised in place of torch's overlapping-memory error from DDP's buffer broadcast, with the switch."""


UNUSED_MARKER = "Expected to have finished reduction in the prior iteration"

UNUSED_HINT = (
    "Some parameters of this model got no gradient in the previous step: the loss did not use them (a branch or "
    "head the forward skipped, a layer built but never called, an output left out of the loss). DDP waits for "
    "every parameter's gradient before it reduces them, so that step's reduction never finished. If the model "
    "leaves parameters unused on purpose, set `ddp.find_unused_parameters: true` (--set "
    "ddp.find_unused_parameters=true): DDP then walks the autograd graph after every forward to find them, which "
    "costs time at each step (more the larger the model). Otherwise use every parameter in the loss, freeze the "
    "unused ones (requires_grad_(False)) or remove them from the model."
)


class UnusedParametersError(RuntimeError):
    """Raised in place of torch's unfinished-reduction error from DDP, naming ``ddp.find_unused_parameters``."""


def ddp_hint(exc: RuntimeError) -> RuntimeError:
    """``exc`` itself, or the error that names the config key that fixes it: a :class:`BufferBroadcastError` for
    the overlapping-buffer error of DDP's buffer broadcast, an :class:`UnusedParametersError` for DDP's
    unfinished reduction (parameters the loss did not use). Raise it ``from exc``."""
    text = str(exc)
    if SHARED_MEMORY_MARKER in text:
        return BufferBroadcastError(f"{exc}\n\n{BUFFER_HINT}")
    if UNUSED_MARKER in text:
        return UnusedParametersError(f"{exc}\n\n{UNUSED_HINT}")
    return exc
