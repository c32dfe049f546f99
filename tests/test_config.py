"""Config validation: defaults, the YAML file, --set overrides, and errors that carry their paths."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import REPO, child_env

from service.config import ConfigError, JobConfig, apply_overrides, load_config


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


def test_validate_command_prints_resolved_config(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("seed: 3\n")
    out = subprocess.run([sys.executable, "-m", "service", "validate", str(path), "--set", "train.epochs=5"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, check=True).stdout  # fmt: skip
    resolved = yaml.safe_load(out)
    assert resolved["seed"] == 3 and resolved["train"]["epochs"] == 5 and resolved["checkpoint"]["keep"] == 3


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
