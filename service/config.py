"""The job config: pydantic models, a YAML file, and ``--set dotted.key=value`` overrides.

Every key has a default, so an empty file (or none) is a valid job: the demo.
Unknown keys are errors, and all errors are reported together, each with its path.
Every float must be finite (checked on the parsed number, so ``1e400`` and
``Infinity`` are caught too), and the input is bounded before anything walks
it: the file's size, the nesting depth, and the values after YAML aliases are
expanded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from service.tasks.registry import BUILTIN_TASKS

_TASK_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ConfigError(ValueError):
    """The job config is invalid; ``errors`` holds one line per problem, each with its path."""

    def __init__(self, errors: list[str], source: str = "the job config") -> None:
        self.errors = errors
        lines = "\n".join(f"  - {error}" for error in errors)
        super().__init__(f"{source} has {len(errors)} error(s):\n{lines}")


class _Section(BaseModel):
    # allow_inf_nan=False: every float field refuses inf and nan after parsing ('1e400', 'Infinity', .inf alike)
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True, allow_inf_nan=False
    )


def _switch(value: Any) -> Any:
    """YAML reads a bare ``on``/``off`` as a boolean; take it back as the word."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


OnOffAuto = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch)]
Amp = Annotated[Literal["auto", "off", "bf16", "fp16"], BeforeValidator(lambda v: "off" if v is False else v)]
Compile = Literal[False, True, "inductor", "aot_eager", "eager"]  # true: inductor; the others: debugging backends

SEED_MAX = 2**32 - 1  # numpy's limit; torch's generators also take (seed * 1_000_003 + epoch) < 2**64
TIMEOUT_MAX = 7 * 24 * 3600  # datetime.timedelta and the C++ stores overflow far above; a week is already absurd


MAX_CONFIG_BYTES = 1 << 20  # a job config is a few hundred bytes; task_options may list some names
MAX_DEPTH = 32  # mappings and lists inside each other, the top level included
MAX_VALUES = 100_000  # keys and values once YAML aliases are expanded (nine levels of *refs: 10**9)
_NOT_FINITE = ("must be a finite number (.inf, .nan, Infinity and 1e400 all read as infinity or not-a-number); "
               "write a plain number such as 0.05")  # fmt: skip


def _port(value: Any) -> int | str:
    """A port number 0 to 65535, or ``auto``: one error either way (a plain union would report one per member)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be a port number from 0 to 65535, or auto")
    if not 0 <= value <= 65535:
        raise ValueError("must be from 0 to 65535 (0 turns the exporter off), or auto")
    return value


Port = Annotated[int | Literal["auto"], PlainValidator(_port)]


def _within(low: int, high: int, fix: str) -> BeforeValidator:
    """Refuse a number outside ``low..high`` before pydantic's int parsing (``1.0e+23`` would overflow it)."""

    def check(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}; {fix}")
        return value

    return BeforeValidator(check)


class TrainConfig(_Section):
    epochs: int = Field(2, ge=1, description="Passes over the training set.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Samples per rank per micro-step.")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step over the whole world, kept under resizes; null: "
        "batch_size x world_size x grad_accum.",
    )
    lr: float = Field(0.05, gt=0)
    grad_accum: int = Field(
        1, ge=1, description="Micro-steps per optimizer step (derived when global_batch_size is set)."
    )
    amp: Amp = "auto"
    sync_batchnorm: OnOffAuto = "auto"
    strategy: Literal["ddp", "dp"] = "ddp"
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="Max gradient norm; null turns clipping off.")
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = Field(0.0, ge=0, description="Where cosine/linear decay ends at the last step; at most lr.")
    warmup_steps: int = Field(0, ge=0)
    compile: Compile = Field(False, description="torch.compile the model (in place, before the DDP wrap).")
    log_every: int = Field(10, ge=1, description="Log a line every N optimizer steps.")
    eval_every: int | None = Field(
        None, ge=1, description="Evaluate every N optimizer steps and at the end; null: at each epoch's end."
    )
    progress_bar: bool = True
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A step whose gradient norm is inf/nan: stop (fail, naming the step) or skip its update."
    )

    @model_validator(mode="after")
    def _one_way_to_accumulate(self) -> TrainConfig:
        if self.global_batch_size is not None and self.grad_accum != 1:
            raise ValueError(
                f"train.grad_accum={self.grad_accum} and train.global_batch_size={self.global_batch_size} are "
                "both set; set only global_batch_size (grad_accum is then derived at every start) or only grad_accum"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}; the schedule decays from lr "
                             f"to min_lr, so set min_lr at most {self.lr} (e.g. --set train.min_lr=0)")  # fmt: skip
        if self.compile and self.strategy == "dp":
            raise ValueError("train.compile works with train.strategy=ddp only (DataParallel copies the module "
                             "every step); set train.strategy=ddp or train.compile=false")  # fmt: skip
        return self


class DataConfig(_Section):
    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    trace: bool = Field(False, description="Write each rank's consumed sample indices to run_dir/trace/.")


class BestConfig(_Section):
    metric: str = Field(min_length=1, description="An eval result's name: loss, or one the task reports.")
    mode: Literal["min", "max"] = Field(description="min: lower is better (loss); max: higher is better.")


class CheckpointConfig(_Section):
    every_steps: int = Field(
        50, ge=0, description="Save every N optimizer steps; 0: only at the end and on preemption."
    )
    keep: int = Field(3, description="How many recent complete checkpoints to keep (at least 2).")
    resume: Literal["auto", "never", "require"] = "auto"
    async_save: bool = Field(False, alias="async", description="Write periodic saves in the background.")
    on_error: Literal["stop", "continue"] = "stop"
    best: BestConfig | None = Field(
        None, description="Keep the best evaluated checkpoint apart from pruning; null: off."
    )

    @field_validator("keep")
    @classmethod
    def _keep_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                f"checkpoint.keep must be at least 2, so that the previous checkpoint survives while the next "
                f"one is written; got {value}. Use --set checkpoint.keep=2"
            )
        return value


class MetricsConfig(_Section):
    port: Port = Field(
        0, description="Base port; rank serves on port + LOCAL_RANK. 0 = off; auto = the OS picks a free port per rank."
    )
    host: str = "127.0.0.1"
    tensorboard: bool = True
    allreduce_timing: bool = Field(
        True,
        description="Time the step's collectives on the host: DDP's gradient all-reduce (a comm hook, about "
        "0.2 ms a step on CPU/gloo), its buffer broadcast and CPU SyncBatchNorm; the straggler score needs it.",
    )


class DDPConfig(_Section):
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    bucket_cap_mb: int | None = Field(
        None, ge=1, description="Gradient bucket size; null keeps torch's default (25 MiB, a small first bucket)."
    )


class DistConfig(_Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_seconds: Annotated[int, _within(1, TIMEOUT_MAX, "at most 7 days; the default is 300 seconds")] = Field(
        300, description="Process-group timeout, 1 to 604800 (7 days)."
    )


class InitFromConfig(_Section):
    path: str = Field(description="A state dict .pt/.pth, a .safetensors file, or a ddp-service checkpoint.")
    strict: bool = Field(True, description="Every key of the model and of the file must match.")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("init_from.path must be a non-empty path to a weights file")
        return value


def _init_from(value: Any) -> Any:
    """``init_from: PATH`` is short for ``init_from: {path: PATH}``."""
    return {"path": value} if isinstance(value, (str, Path)) else value


class JobConfig(_Section):
    task: str = "shapes-segmentation"
    task_options: dict[str, Any] = Field(default_factory=dict)
    run_dir: str = "runs/demo"
    init_from: Annotated[InitFromConfig | None, BeforeValidator(_init_from)] = Field(
        None, description="Start a fresh run from these model weights (a resume's checkpoint wins)."
    )
    seed: Annotated[int, _within(0, SEED_MAX, "pick a seed below 2**32, e.g. 0")] = Field(
        0, description="0 to 2**32 - 1."
    )
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    ddp: DDPConfig = DDPConfig()
    dist: DistConfig = DistConfig()

    @field_validator("task")
    @classmethod
    def _task_reference(cls, value: str) -> str:
        if value in BUILTIN_TASKS or _TASK_REF.match(value):
            return value
        names = ", ".join(sorted(BUILTIN_TASKS))
        raise ValueError(f"unknown task {value!r}; use a built-in name ({names}) or 'package.module:function'")

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("run_dir must be a non-empty path")
        return value


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


def build_config(data: Mapping[str, Any], source: str = "The job config") -> JobConfig:
    """Validate a plain mapping; every error is collected into one :class:`ConfigError`."""
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_format_error(error) for error in exc.errors()], source) from exc


def _format_error(error: Mapping[str, Any]) -> str:
    path = ".".join(str(part) for part in error["loc"]) or "(top level)"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key; check the spelling against the README's config reference"
    if error["type"] == "finite_number":
        message = _NOT_FINITE
    if "input" in error and not isinstance(error["input"], (dict, list)):
        message = f"{message} (got {error['input']!r})"
    return f"{path}: {message}"


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> JobConfig:
    """The whole config pipeline: file (optional) → overrides → validated :class:`JobConfig`."""
    data = read_yaml(path) if path is not None else {}
    source = f"The config file {path}" if path is not None else "The job config"
    return build_config(apply_overrides(data, overrides), source)


def config_as_yaml(config: JobConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
