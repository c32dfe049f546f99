"""Resolve a task reference and build it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from service.tasks.base import Task, TaskSpec
from service.tasks.registry import BUILTIN_TASKS


class TaskError(ValueError):
    """A task reference cannot be loaded or its build function returned the wrong thing."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def resolve(reference: str) -> Any:
    """Turn ``name`` or ``package.module:function`` into the build function."""
    target = BUILTIN_TASKS.get(reference, reference)
    module_name, sep, attribute = target.partition(":")
    if not sep:
        raise TaskError(
            f"The task {reference!r} is neither a built-in task ({', '.join(sorted(BUILTIN_TASKS))}) "
            "nor a 'package.module:function' reference."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(
            f"The task module {module_name!r} could not be imported ({exc}). Install the package that "
            "provides it, or put its folder on PYTHONPATH."
        ) from exc
    except (Exception, SystemExit) as exc:  # a module that raises or calls sys.exit at import
        raise TaskError(
            f"The task module {module_name!r} failed while being imported: {_describe(exc)}. Fix the module "
            f"(python -c 'import {module_name}' shows the traceback); nothing was trained."
        ) from exc
    try:
        return getattr(module, attribute)
    except AttributeError as exc:
        raise TaskError(f"The task module {module_name!r} has no function {attribute!r}.") from exc


def load_task(reference: str, seed: int, options: Mapping[str, Any]) -> Task:
    """Build a task; a build function gets one :class:`TaskSpec` and must return a :class:`Task`."""
    build = resolve(reference)
    try:
        task = build(TaskSpec(seed=seed, options=dict(options)))
    except (Exception, SystemExit) as exc:
        raise TaskError(
            f"The task function {reference!r} failed while building the task: {_describe(exc)}. Fix the "
            "function or its task_options; nothing was trained."
        ) from exc
    if not isinstance(task, Task):
        raise TaskError(
            f"The task function {reference!r} returned {type(task).__name__}, not service.tasks.base.Task. "
            "Return Task(model=..., train_set=..., eval_set=..., loss_fn=..., metric_fn=..., metric_name=...) "
            "or Task(model=..., train_set=..., eval_set=..., step_fn=...)."
        )
    if problems := task.problems():
        raise TaskError(f"The task {reference!r} cannot be trained: {'; '.join(problems)}.")
    return task
