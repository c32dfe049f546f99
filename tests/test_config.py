"""Config validation: defaults, the YAML file, --set overrides, and errors that carry their paths."""

from __future__ import annotations

import math
import subprocess
import sys
import typing

import pytest
import yaml
from conftest import REPO, child_env
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from service.config import (
    MAX_DEPTH,
    MAX_VALUES,
    ConfigError,
    JobConfig,
    apply_overrides,
    config_keys,
    load_config,
    nearest_key,
)


def test_defaults_are_a_valid_job():
    config = load_config(None)
    assert config.task == "shapes-segmentation"
    assert config.train.batch_size == 8 and config.train.strategy == "ddp"
    assert config.metrics.port == 0


def test_issue_example_keys_load(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "task: shapes-segmentation\nrun_dir: runs/demo\nseed: 0\n"
        "train: {epochs: 2, max_steps: null, batch_size: 8, lr: 0.05, grad_accum: 1, amp: auto,"
        " sync_batchnorm: auto, strategy: ddp}\n"
        "data: {num_workers: 0}\ncheckpoint: {every_steps: 50, keep: 3}\nmetrics: {port: 0, host: 127.0.0.1}\n"
    )
    assert load_config(path) == JobConfig()


def test_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {lr: 0.1}\n")
    config = load_config(path, ["train.lr=1e-3", "train.max_steps=7", "ddp.broadcast_buffers=false",
                                "task_options.width=4", "train.grad_clip=null"])  # fmt: skip
    assert config.train.lr == 1e-3 and config.train.max_steps == 7
    assert config.ddp.broadcast_buffers is False and config.task_options == {"width": 4}
    assert config.train.grad_clip is None


def test_yaml_on_off_words_are_switches():
    config = load_config(None, ["train.sync_batchnorm=off", "train.amp=off"])
    assert config.train.sync_batchnorm == "off" and config.train.amp == "off"
    assert load_config(None, ["train.sync_batchnorm=on"]).train.sync_batchnorm == "on"


def test_every_error_is_reported_with_its_path(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {batch_size: 0, lr: -1, amp: fp8, bogus: 1}\nmetrics: {port: 99999}\nextra: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["checkpoint.keep=0"])
    errors = info.value.errors
    for expected in ("train.batch_size", "train.lr", "train.amp", "train.bogus: unknown key",
                     "metrics.port", "extra: unknown key", "checkpoint.keep"):  # fmt: skip
        assert any(error.startswith(expected) for error in errors), (expected, errors)
    assert len(errors) == 7
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [("train.lr", "dotted.key=value"), ("=3", "dotted.key=value"), ("seed.x=1", "seed is a value")],
)
def test_bad_override_syntax(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        apply_overrides({"seed": 1}, [override])


def test_unknown_task_name_lists_built_ins():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["task=shapes"])
    assert "task: " in str(info.value) and "digits-classification" in str(info.value)


@pytest.mark.parametrize(("text", "fragment"), [("- a\n- b\n", "not a mapping"), ("train: [\n", "not valid YAML")])
def test_bad_files(tmp_path, text, fragment):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/job.yaml")


@pytest.mark.e2e
def test_validate_command_prints_resolved_config(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("seed: 3\n")
    out = subprocess.run([sys.executable, "-m", "service", "validate", str(path), "--set", "train.epochs=5"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, check=True).stdout  # fmt: skip
    resolved = yaml.safe_load(out)
    assert resolved["seed"] == 3 and resolved["train"]["epochs"] == 5 and resolved["checkpoint"]["keep"] == 3


@pytest.mark.e2e
def test_validate_command_fails_on_errors(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {batch_size: -2}\nnope: 1\n")
    proc = subprocess.run([sys.executable, "-m", "service", "validate", str(path)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert "train.batch_size" in proc.stderr and "nope: unknown key" in proc.stderr


def test_example_configs_validate():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_config(path)


def test_reference_config_spells_out_the_defaults():
    """examples/shapes.yaml documents every key at its default; it must not drift."""
    assert load_config(REPO / "examples" / "shapes.yaml") == JobConfig()


def _float_fields(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Every float key of the config, found by walking the models (so a new float field is covered too)."""
    found = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _float_fields(annotation, f"{prefix}{name}.")
        elif float in (annotation, *typing.get_args(annotation)):
            found.append(f"{prefix}{field.alias or name}")
    return found


NOT_FINITE = ["1e400", "-1e400", "inf", "Infinity", "-Infinity", "NaN", ".inf", "-.inf", ".nan"]


@pytest.mark.parametrize("value", NOT_FINITE)
def test_every_float_field_refuses_non_finite_values_after_parsing(tmp_path, value):
    """Issue 15: '1e400' and 'Infinity' are strings to YAML and became inf only when pydantic parsed them."""
    fields = _float_fields()
    assert {"train.lr", "train.momentum", "train.weight_decay", "train.grad_clip"} <= set(fields), fields
    for key in fields:
        section, name = key.split(".")
        path = tmp_path / "job.yaml"
        path.write_text(f"{section}:\n  {name}: {value}\n")
        for source, overrides in ((path, []), (None, [f"{key}={value}"])):
            with pytest.raises(ConfigError) as info:
                load_config(source, overrides)
            (error,) = info.value.errors
            assert error.startswith(f"{key}: must be a finite number") and "such as 0.05" in error, error


@settings(max_examples=200, deadline=None, database=None)
@given(st.one_of(st.floats(), st.floats().map(repr), st.sampled_from(NOT_FINITE), st.sampled_from(["1e308", "2e308"])))
def test_a_float_that_validates_is_finite(value):
    for key in _float_fields():
        try:
            config = load_config(None, [f"{key}={value}"])
        except ConfigError:
            continue
        section, name = key.split(".")
        assert math.isfinite(getattr(getattr(config, section), name)), (key, value)


def test_deep_or_aliased_config_is_refused_with_its_limits(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("task_options:\n  x: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n")
    with pytest.raises(ConfigError, match=f"more than {MAX_DEPTH} levels deep \\(line 2, column"):
        load_config(path)
    within = "[" * (MAX_DEPTH - 2) + "1" + "]" * (MAX_DEPTH - 2)  # task_options and x are two levels
    assert load_config(None, [f"task_options.x={within}"]).task_options["x"]
    # an anchor at depth 20 used at depth 20 is 40 deep once expanded: the walk measures the expanded data
    path.write_text("task_options:\n  a: &a " + "[" * 18 + "]" * 18 + "\n  b: " + "[" * 18 + "*a" + "]" * 18 + "\n")
    with pytest.raises(ConfigError, match=f"more than {MAX_DEPTH} levels deep"):
        load_config(path)
    with pytest.raises(ConfigError, match=f"more than {MAX_VALUES} keys and values once its YAML aliases"):
        load_config(None, ["task_options.x=[&a [1,2,3,4,5,6,7,8,9,10], " + ", ".join(["*a"] * 10_000) + "]"])
    with pytest.raises(ConfigError, match="the config with its --set overrides nests"):
        load_config(None, ["task_options." + ".".join(["k"] * MAX_DEPTH) + "=1"])


def test_a_mistyped_set_key_is_the_command_lines_error_with_the_nearest_key():
    """Issue 17: `--set train.lrr=0.1` was reported as an error of "the config file", with no suggestion."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lrr=0.1"])
    assert str(info.value).startswith("The command line has 1 error(s)")
    assert info.value.errors == ["train.lrr: unknown key, given as --set train.lrr=0.1; did you mean train.lr?"]
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trian.lr=0.1", "checkpoint.asycn=true"])
    assert info.value.errors == [
        "checkpoint.asycn: unknown key, given as --set checkpoint.asycn=true; did you mean checkpoint.async?",
        "trian: unknown key, given as --set trian.lr=0.1; did you mean train.lr?",
    ]


def test_a_typo_in_the_file_is_the_files_error_and_a_mix_names_both(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  bach_size: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"The config file {path} has 1 error(s)")
    assert info.value.errors == ["train.bach_size: unknown key; did you mean train.batch_size?"]
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.lr=-1"])
    assert str(info.value).startswith(f"The config file {path} with the command line's --set options has 2 error")
    assert "train.lr: Input should be greater than 0 (got -1), given as --set train.lr=-1" in info.value.errors


def test_every_key_suggests_itself_and_nonsense_suggests_nothing():
    keys = list(config_keys())
    assert {"train", "train.lr", "checkpoint.async", "logging.all_ranks", "task_options"} <= set(keys)
    assert all(nearest_key(key) == key for key in keys)
    assert nearest_key("zzzzqqq") is None


@pytest.mark.parametrize("value", ["often", "-1", "true", "1.5"])
def test_a_bad_snapshot_interval_is_refused_naming_the_key_and_what_it_takes(value):
    with pytest.raises(ConfigError, match=r"checkpoint\.snapshot_every: .*must be auto .* or a whole number of steps"):
        load_config(None, [f"checkpoint.snapshot_every={value}"])
    assert load_config(None).checkpoint.snapshot_every == "auto"  # the default
    assert [load_config(None, [f"checkpoint.snapshot_every={v}"]).checkpoint.snapshot_every for v in (0, 7)] == [0, 7]


@pytest.mark.parametrize("value", ["0", "-5", "soon", "true", ".inf", "1e400", "604801"])
def test_a_bad_snapshot_time_ceiling_is_refused_naming_the_key_and_what_it_takes(value):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"checkpoint.snapshot_max_seconds={value}"])
    assert len(info.value.errors) == 1 and info.value.errors[0].startswith("checkpoint.snapshot_max_seconds: must be")
    assert load_config(None).checkpoint.snapshot_max_seconds == 60  # the default
    assert load_config(None, ["checkpoint.snapshot_max_seconds=2.5"]).checkpoint.snapshot_max_seconds == 2.5


def test_a_time_ceiling_with_a_fixed_snapshot_interval_is_refused_as_unused():
    """A fixed interval is taken as given: a snapshot_max_seconds other than its default would be a silent setting."""
    with pytest.raises(ConfigError, match=r"checkpoint\.snapshot_max_seconds=30 applies to checkpoint\.snapshot_"
                       r"every=auto only.*set checkpoint\.snapshot_every=auto"):  # fmt: skip
        load_config(None, ["checkpoint.snapshot_every=5", "checkpoint.snapshot_max_seconds=30"])
    assert load_config(None, ["checkpoint.snapshot_every=5", "checkpoint.snapshot_max_seconds=60"])  # the default
