"""Reading a job config safely: a bounded YAML file, ``--set dotted.key=value`` overrides, one error type.

The input is bounded before anything walks it: the file's size, the nesting
depth, and the number of values after YAML aliases are expanded. The models
that validate what is read are in :mod:`service.config`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

MAX_CONFIG_BYTES = 1 << 20  # a job config is a few hundred bytes; task_options may list some names
MAX_DEPTH = 32  # mappings and lists inside each other, the top level included
MAX_VALUES = 100_000  # keys and values once YAML aliases are expanded (nine levels of *refs: 10**9)


class ConfigError(ValueError):
    """The job config is invalid; ``errors`` holds one line per problem, each with its path."""

    def __init__(self, errors: list[str], source: str = "the job config") -> None:
        self.errors = errors
        lines = "\n".join(f"  - {error}" for error in errors)
        super().__init__(f"{source} has {len(errors)} error(s):\n{lines}")


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` set; values are parsed as YAML."""
    result: dict[str, Any] = _deep_copy(data)
    errors = []
    for override in overrides:
        key, sep, raw = override.partition("=")
        shown = repr(override if len(override) <= 120 else f"{override[:120]}...")
        if not sep or not key.strip():
            errors.append(f"--set {shown}: write it as dotted.key=value, e.g. train.lr=0.1")
            continue
        try:
            _set_path(result, key.strip().split("."), _parse_yaml(raw) if raw.strip() else raw)
        except (TypeError, yaml.YAMLError) as exc:
            errors.append(f"--set {shown}: {exc}")
        except ValueError as exc:  # past a bound of _parse_yaml
            errors.append(f"--set {shown}: its value {exc}")
    if not errors:
        try:
            _check_bounds(result)  # a long dotted key nests too
        except ValueError as exc:
            errors.append(f"the config with its --set overrides {exc}")
    if errors:
        raise ConfigError(errors, "The command line")
    return result


def _too_deep(where: str = "") -> ValueError:
    return ValueError(f"nests mappings and lists more than {MAX_DEPTH} levels deep{where}; a job config needs "
                      "a few, so flatten task_options (or pass deep data to the task as a file path)")  # fmt: skip


def _check_bounds(data: Any) -> None:
    """Refuse, with ``ValueError``, data deeper than MAX_DEPTH or with more than MAX_VALUES keys and values.

    The walk visits shared (aliased) nodes once per reference, so it measures
    the expanded size, and it stops at the first value past either limit: a
    small YAML file of nested aliases is refused in a moment, not expanded.
    """
    stack, seen = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ValueError(
                f"holds more than {MAX_VALUES} keys and values once its YAML aliases (*name) are expanded; "
                "write the values out, or pass large data to the task as a file path in task_options"
            )
        if isinstance(node, (Mapping, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            children = [*node.keys(), *node.values()] if isinstance(node, Mapping) else node
            stack.extend((child, depth + 1) for child in children)


def _parse_yaml(text: str) -> Any:
    """``yaml.safe_load``, bounded: the depth is read from the parser's events first (the composer recurses,
    so 4,000 levels would overflow Python's stack), then the composed data is checked by :func:`_check_bounds`."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                raise _too_deep(f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    data = yaml.safe_load(text)
    _check_bounds(data)
    return data


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _deep_copy(value) if isinstance(value, Mapping) else value for key, value in data.items()}


def _set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    node = target
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise TypeError(f"{'.'.join(path[: depth + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Load a YAML mapping, with errors that name the file."""
    file = Path(path)
    try:
        with open(file, "rb") as stream:  # a bounded read: the path may be a pipe, or /dev/zero
            raw = stream.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError([f"it is larger than {MAX_CONFIG_BYTES} bytes; a job config is a few hundred, so "
                               "pass large data to the task as a file path in task_options"],
                              f"The config file {file}")  # fmt: skip
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = (f"it is not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start} cannot be "
                  "decoded; save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")  # fmt: skip
        raise ConfigError([reason], f"The config file {file}") from None
    except OSError as exc:
        raise ConfigError([f"cannot read {file}: {exc.strerror or exc}"], f"The config file {file}") from exc
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], f"The config file {file}") from exc
    except ValueError as exc:
        raise ConfigError([f"it {exc}"], f"The config file {file}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"the top level is a {type(data).__name__}, not a mapping of keys"], f"The config file {file}"
        )
    return data
