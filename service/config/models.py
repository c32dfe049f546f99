"""The job config: pydantic models, validated from a YAML file and ``--set dotted.key=value`` overrides.

Every key has a default, so an empty file (or none) is a valid job: the demo.
Unknown keys are errors (with the nearest valid key), and all errors are
reported together, each with its path and where it was given. Every float must
be finite (checked on the parsed number, so ``1e400`` and ``Infinity`` are
caught too). Reading the file and the overrides, bounded, is
:mod:`service.config.reading`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
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

from service.config.reading import ConfigError, apply_overrides, read_yaml
from service.tasks.registry import BUILTIN_TASKS

_TASK_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


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

HANG_TIMEOUT_MIN = 3  # the watchdog's heartbeat is 1 s: a shorter timeout could not tell stopped from waiting


def _finite_number(value: Any, fix: str) -> float:
    """``value`` as a finite number (YAML reads 1e400, Infinity and 1e9 as strings), or ``fix`` as the error."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(fix) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(fix)
    if not math.isfinite(value):
        raise ValueError(_NOT_FINITE)
    return float(value)


def _hang_timeout(value: Any) -> float | str:
    """``auto``, or seconds from :data:`HANG_TIMEOUT_MIN` to :data:`TIMEOUT_MAX`: one error naming the fix."""
    if value == "auto":
        return "auto"
    fix = (f"must be auto (10 x the p99 optimizer-step time, at least 30 s) or a number of seconds from "
           f"{HANG_TIMEOUT_MIN} to {TIMEOUT_MAX}, e.g. 120")  # fmt: skip
    value = _finite_number(value, fix)
    if not HANG_TIMEOUT_MIN <= value <= TIMEOUT_MAX:
        raise ValueError(fix)
    return float(value)


HangTimeout = Annotated[float | Literal["auto"], PlainValidator(_hang_timeout)]


def _snapshot_every(value: Any) -> int | str:
    """``auto``, or a whole number of steps (0: off): one error naming the fix."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be auto (an interval that keeps the snapshots' cost at 0.5% of the step time or less, "
                         "every step where that holds) or a whole number of steps, 0 for none, e.g. 1")  # fmt: skip
    return value


SnapshotEvery = Annotated[int | Literal["auto"], PlainValidator(_snapshot_every)]


SNAPSHOT_MAX_SECONDS = 60.0  # checkpoint.snapshot_max_seconds's default


def _snapshot_max_seconds(value: Any) -> float:
    """Seconds above 0, at most :data:`TIMEOUT_MAX`: one error naming the fix."""
    fix = (f"must be a number of seconds above 0 and at most {TIMEOUT_MAX}: the most training one failure may lose "
           "under checkpoint.snapshot_every=auto, e.g. 60")  # fmt: skip
    value = _finite_number(value, fix)
    if not 0 < value <= TIMEOUT_MAX:
        raise ValueError(fix)
    return float(value)


SnapshotMaxSeconds = Annotated[float, PlainValidator(_snapshot_max_seconds)]


def _within(low: int, high: int, fix: str) -> BeforeValidator:
    """Refuse a number outside ``low..high`` before pydantic's int parsing (``1.0e+23`` would overflow it)."""

    def check(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(_NOT_FINITE)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}; {fix}")
        return value

    return BeforeValidator(check)


def _grad_clip(value: Any) -> float | str | None:
    """``auto``, null (off), or a positive finite number: one error naming the fix."""
    if value is None or value == "auto":
        return value
    fix = "must be auto (1.0 when the service builds the optimizer, none when the task or script brings its own), "\
          "null (no clipping) or a positive number, e.g. 1.0"  # fmt: skip
    value = _finite_number(value, fix)
    if value <= 0:
        raise ValueError(fix)
    return value


GradClip = Annotated[float | Literal["auto"] | None, PlainValidator(_grad_clip)]


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
    grad_clip: GradClip = Field(
        "auto",
        description="Max gradient norm; null turns clipping off; auto: 1.0 with the service's optimizer, none with "
        "a task's own (optimizer_fn).",
    )
    lr_schedule: Literal["auto", "cosine", "linear", "constant"] = Field(
        "auto",
        description="auto: cosine with the service's optimizer; with a task's own optimizer (optimizer_fn) and no "
        "scheduler_fn, none (constant).",
    )
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
    stream_resume: Literal["exact", "restart"] = Field(
        "exact",
        description="A stream (an iterable dataset) on a resume: exact (its saved position, at the same world size; "
        "refused otherwise) or restart (afresh: samples may repeat or be skipped).",
    )


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
    snapshot_every: SnapshotEvery = Field(
        "auto",
        description="Keep the state of every N-th optimizer step in node-local shared memory; 0: off; auto: the N "
        "that keeps their cost at 0.5% of the step time or less, measured through the run (every step for small "
        "models), within checkpoint.snapshot_max_seconds.",
    )
    snapshot_max_seconds: SnapshotMaxSeconds = Field(
        SNAPSHOT_MAX_SECONDS,
        description="Under snapshot_every=auto: the most training time one failure may lose; the interval never "
        "spans more than this many seconds of typical steps.",
    )
    snapshot_dir: str = Field(
        "/dev/shm", min_length=1, description="The shared-memory file system that holds the snapshots (a tmpfs)."
    )

    @model_validator(mode="after")
    def _max_seconds_with_auto(self) -> CheckpointConfig:
        # A value other than the default that a fixed interval would leave unused is refused (no silent settings)
        if self.snapshot_max_seconds != SNAPSHOT_MAX_SECONDS and self.snapshot_every != "auto":
            raise ValueError(f"checkpoint.snapshot_max_seconds={self.snapshot_max_seconds:g} applies to "
                             f"checkpoint.snapshot_every=auto only, and snapshot_every is {self.snapshot_every} (a "
                             "fixed interval is taken as given); drop snapshot_max_seconds, or set "
                             "checkpoint.snapshot_every=auto")  # fmt: skip
        return self

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
        "20 µs of CPU a step per bucket over DDP's built-in all-reduce), its buffer broadcast and CPU SyncBatchNorm; "
        "the straggler score needs it. Only with the exporter on (metrics.port); false: DDP's built-in all-reduce.",
    )
    goodput: bool = Field(
        True,
        description="Rank 0 keeps the goodput ledger run_dir/goodput.jsonl: where the job's wall time went, across "
        "restarts (summary.json's goodput, the ddp_job_goodput_* gauges, ddp-service goodput RUN_DIR).",
    )
    goodput_every_seconds: float = Field(
        10.0, gt=0, le=3600, description="How often rank 0 appends a goodput record (also at start and at the end)."
    )


class LoggingConfig(_Section):
    all_ranks: bool = Field(
        False,
        description="Every rank logs INFO lines (each step line then adds that rank's own numbers); "
        "false: rank 0 logs the world's numbers and the other ranks only warnings and errors.",
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
    hang_timeout_seconds: HangTimeout = Field(
        "auto",
        description="No progress on a rank for this long is a hang: the watchdog names the rank behind and exits "
        "so torchrun restarts the world. auto: max(10 x the p99 step time, 30 s); dist.timeout_seconds until a "
        "step is measured.",
    )
    data_timeout_seconds: Annotated[float, _within(HANG_TIMEOUT_MIN, TIMEOUT_MAX, "a number of seconds, e.g. 600")] = (
        Field(
            600.0,
            description="A rank waiting for its own data (its loader alive) is slow, not hung: the watchdog reports it "
            "once it passes the hang timeout and counts it a hang only after this many seconds; its peers wait as "
            "long. 3 to 604800.",
        )
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
    logging: LoggingConfig = LoggingConfig()

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


def build_config(data: Mapping[str, Any], source: str = "The job config",
                 overrides: Mapping[str, str] | None = None, file_source: str | None = None) -> JobConfig:  # fmt: skip
    """Validate a plain mapping; every error is collected into one :class:`ConfigError`.

    ``overrides`` maps each ``--set`` key to its text, so an error in a value
    the command line set names that ``--set`` (and the error is the command
    line's, not the file's); ``file_source`` names the file for the others.
    """
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        overrides = overrides or {}
        lines, from_line = [], 0
        for error in exc.errors():
            given = _given_by(error["loc"], overrides)
            from_line += given is not None
            lines.append(_format_error(error, given))
        if overrides and from_line == len(lines):
            source = "The command line"
        elif from_line:
            source = f"{file_source or 'The job config'} with the command line's --set options"
        raise ConfigError(lines, source) from exc


def _given_by(loc: tuple[Any, ...], overrides: Mapping[str, str]) -> tuple[str, str] | None:
    """(key, text) of the ``--set`` that set the value at ``loc``, a value above it, or one inside it."""
    path = [str(part) for part in loc]
    for depth in range(len(path), 0, -1):
        key = ".".join(path[:depth])
        if key in overrides:
            return key, overrides[key]
    inside = [key for key in overrides if path and key.startswith(".".join(path) + ".")]
    return (inside[0], overrides[inside[0]]) if inside else None


def config_keys(model: type[BaseModel] = JobConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the config, sections included (``train``, ``train.lr``, ..., ``checkpoint.async``)."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        yield key
        if isinstance(field.annotation, type) and issubclass(field.annotation, _Section):
            yield from config_keys(field.annotation, f"{key}.")


def nearest_key(key: str) -> str | None:
    """The valid dotted key closest to a mistyped one (difflib's ratio, at least 0.6), if any is close."""
    match = difflib.get_close_matches(key, list(config_keys()), n=1, cutoff=0.6)
    return match[0] if match else None


def _format_error(error: Mapping[str, Any], given: tuple[str, str] | None = None) -> str:
    path = ".".join(str(part) for part in error["loc"]) or "(top level)"
    origin = f", given as --set {given[1]}" if given is not None else ""
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        typed = given[0] if given is not None and given[0].startswith(f"{path}.") else path  # trian.lr, not trian
        nearest = nearest_key(typed)
        hint = f"did you mean {nearest}?" if nearest else "check the spelling against docs/config.md"
        return f"{path}: unknown key{origin}; {hint}"
    if error["type"] == "finite_number":
        message = _NOT_FINITE
    if "input" in error and not isinstance(error["input"], (dict, list)):
        message = f"{message} (got {error['input']!r})"
    return f"{path}: {message}{origin}"


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> JobConfig:
    """The whole config pipeline: file (optional) → overrides → validated :class:`JobConfig`."""
    overrides = list(overrides)
    data = read_yaml(path) if path is not None else {}
    source = f"The config file {path}" if path is not None else "The job config"
    given = {key.strip(): text for text in overrides for key, sep, _ in [text.partition("=")] if sep}
    return build_config(apply_overrides(data, overrides), source, given, source if path is not None else None)


def config_as_yaml(config: JobConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
