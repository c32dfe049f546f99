"""Fast tests of the weights alone (issue 17): export, init_from, and the best checkpoint kept apart from pruning.

Real files, real checkpoints written by the real writer, real models; nothing under test is mocked.
The checkpoint a real run writes is exported in tests/test_export_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import IN_CI, REPO, child_env
from torch import nn

from service.cli import main
from service.config import ConfigError, JobConfig, load_config
from service.state import checkpoint as checkpoint_module
from service.state.best import BEST_NAME, BestMetricError, BestRule, read_best
from service.state.checkpoint import Checkpointer, Rank0Checkpointer
from service.state.checkpoint_io import FORMAT, manifest_name, state_name, write_checkpoint
from service.state.resume import config_hash
from service.state.weights import (
    WeightsError,
    export_weights,
    init_model,
    load_weights,
    read_weights,
    strip_prefixes,
)
from service.tasks.shapes import UNet

HASH = config_hash(JobConfig())


@pytest.fixture(autouse=True)
def _service_logs_reach_caplog(monkeypatch):
    """configure_logging (if another test ran it) stops propagation; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("service"), "propagate", True)


class TinyGPT(nn.Module):
    """A token embedding and an output head that share one tensor, as GPT-2 does."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.embed(tokens))))


def full_state(model: nn.Module, step: int = 1) -> dict:
    """A checkpoint state as the loop writes it (every key a resume needs), around ``model``'s weights."""
    return {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step},
        "loop": {"epoch": 0, "global_step": step, "samples_seen": 0, "epochs_completed": 0, "cursor": 0},
        "rng": {"torch": torch.get_rng_state()},
        "config": JobConfig().model_dump(mode="json"),
    }


def run_dir_with(tmp_path: Path, model: nn.Module, *steps: int) -> Path:
    run_dir = tmp_path / "run"
    for step in steps:
        write_checkpoint(run_dir / "checkpoints", step, full_state(model, step), HASH)
    return run_dir


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


# --- export -----------------------------------------------------------------------------------------------------


def test_tied_weights_export_to_safetensors_and_pt_and_load_back_strict(tmp_path, capsys):
    torch.manual_seed(0)
    trained = TinyGPT()
    run_dir = run_dir_with(tmp_path, trained, 3)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert "1 tied tensors written as copies" in capsys.readouterr().out
    fresh = TinyGPT()
    fresh.load_state_dict(safetensors.torch.load_file(out), strict=True)
    assert same_weights(fresh, trained) and fresh.head.weight is fresh.embed.weight  # the model ties them again
    assert set(safetensors.torch.load_file(out)) == set(trained.state_dict())  # every key present

    assert main(["export", str(run_dir), "--step", "3", "--format", "pt", str(tmp_path / "model.bin")]) == 0
    other = TinyGPT()
    other.load_state_dict(torch.load(tmp_path / "model.bin", weights_only=True), strict=True)
    assert same_weights(other, trained)


def test_export_strips_wrapper_prefixes_and_refuses_two_keys_that_collide():
    assert list(strip_prefixes({"module._orig_mod.a.w": 1, "module.b._orig_mod.c": 2, "module": 3})) == [
        "a.w",
        "b.c",
        "module",
    ]
    with pytest.raises(WeightsError, match="both name 'a'"):
        strip_prefixes({"module.a": 1, "a": 2})


def test_a_corrupted_checkpoint_is_refused_before_its_state_is_read(tmp_path, capsys):
    """A state whose bytes no longer match its manifest never reaches torch.load: the pickle in it would run."""
    run_dir = run_dir_with(tmp_path, TinyGPT(), 2)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = run_dir / "checkpoints" / state_name(2)
    torch.save({"format": 1, "model": Payload()}, path)  # same name, the old manifest: the sha256 differs
    out = tmp_path / "out.safetensors"
    assert main(["export", str(run_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not match the sha256" in err or "bytes, its manifest says" in err
    assert "step-00000002.pt" in err and "pick another step" in err
    assert not out.exists() and not marker.exists()


def test_export_bad_input_exits_2_with_a_sentence_that_names_the_fix(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(empty), str(tmp_path / "a.safetensors")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err

    run_dir = run_dir_with(tmp_path, TinyGPT(), 2, 4)
    assert main(["export", str(run_dir), "--step", "3", str(tmp_path / "a.safetensors")]) == 2
    assert "no checkpoint of step 3; it has steps 2, 4. Pass one of those" in capsys.readouterr().err

    assert main(["export", str(run_dir), "--step", "best", str(tmp_path / "a.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "has no best checkpoint" in err and "checkpoint.best: {metric: NAME, mode: min|max}" in err

    assert main(["export", str(run_dir), str(tmp_path / "missing" / "a.safetensors")]) == 2
    assert "does not exist; create it first (mkdir -p" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "a.pt")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.pt"))


def require_root(why: str) -> None:
    if os.geteuid() != 0:
        message = f"{why} needs root (mknod)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def test_export_onto_a_device_leaves_the_device_and_exits_2_naming_it(tmp_path, capsys):
    """Issue 24: `export RUN_DIR /dev/null` as root renamed its file over /dev/null. A null device of the test's own
    (the real one is never touched) must still be that device afterwards."""
    require_root("making a character device")
    run_dir = run_dir_with(tmp_path, TinyGPT(), 2)
    device = tmp_path / "null"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    for fmt in ("safetensors", "pt"):
        assert main(["export", str(run_dir), "--format", fmt, str(device)]) == 2
        err = capsys.readouterr().err
        assert f"{device} is a character device, not a regular file" in err and "wrote nothing" in err, err
        assert "name a new file" in err
        info = os.lstat(device)
        assert stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(1, 3)
    with pytest.raises(WeightsError, match="is a character device"):  # the library call, not only the command
        export_weights({"w": torch.zeros(2)}, device, "pt", {})
    assert stat.S_ISCHR(os.lstat(device).st_mode) and not list(tmp_path.glob(".null.*"))


def test_export_onto_a_fifo_a_symlink_or_a_directory_leaves_each_as_it_was(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path, TinyGPT(), 2)
    fifo, link, target, directory = tmp_path / "pipe", tmp_path / "link.pt", tmp_path / "kept.pt", tmp_path / "d"
    os.mkfifo(fifo)
    target.write_bytes(b"not yours")
    link.symlink_to(target)
    directory.mkdir()
    cases = ((fifo, "a FIFO (named pipe)", "name a new file"),
             (link, f"a symbolic link to {target}", f"name the file itself (export writes {target} if you pass"),
             (directory, "a directory", f"name the file to write, e.g. {directory / 'model.safetensors'}"))  # fmt: skip
    for out, kind, fix in cases:
        assert main(["export", str(run_dir), str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{out} is {kind}, not a regular file" in err and "left it alone and wrote nothing" in err, err
        assert fix in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and target.read_bytes() == b"not yours"
    assert directory.is_dir() and not list(directory.iterdir())
    assert main(["export", str(run_dir), str(target)]) == 0  # a regular file is replaced, as before
    assert torch.load(target, weights_only=True).keys() == TinyGPT().state_dict().keys()  # .pt: the pt format


# --- init_from --------------------------------------------------------------------------------------------------


def test_init_from_reads_a_state_dict_a_safetensors_file_and_a_service_checkpoint(tmp_path):
    torch.manual_seed(1)
    source = UNet(width=2)
    plain, wrapped, tensors = tmp_path / "w.pt", tmp_path / "ddp.pth", tmp_path / "w.safetensors"
    torch.save(source.state_dict(), plain)
    torch.save({f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}, wrapped)  # DDP(compile(m))
    safetensors.torch.save_file(source.state_dict(), tensors)
    run_dir = run_dir_with(tmp_path, source, 5)
    for path in (plain, wrapped, tensors, run_dir / "checkpoints" / state_name(5), run_dir):
        torch.manual_seed(2)
        model = UNet(width=2)
        assert not same_weights(model, source)
        init_model(model, path)
        assert same_weights(model, source), path


def test_init_from_a_checkpoint_whose_checksum_fails_or_lacks_its_manifest_is_refused(tmp_path):
    run_dir = run_dir_with(tmp_path, UNet(width=2), 5)
    state = run_dir / "checkpoints" / state_name(5)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="does not match the sha256 in its manifest"):
        init_model(UNet(width=2), state)
    lone = tmp_path / "copied.pt"
    torch.save(full_state(UNet(width=2)), lone)
    with pytest.raises(WeightsError, match="checkpoint without its manifest.*ddp-service export"):
        init_model(UNet(width=2), lone)


def test_init_from_names_missing_and_unexpected_keys_with_counts_and_strict_false_loads_the_rest(tmp_path, caplog):
    torch.manual_seed(3)
    source = UNet(width=2)
    weights = dict(source.state_dict())
    dropped = [key for key in weights if key.startswith("dec.")]
    for key in dropped:
        del weights[key]
    weights["extra.weight"] = torch.zeros(3)
    path = tmp_path / "partial.safetensors"
    safetensors.torch.save_file(weights, path)
    model = UNet(width=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError) as caught:
        init_model(model, path)
    message = str(caught.value)
    assert f"{len(dropped)} (dec.0.weight, " in message and "keys of the model are not in the file" in message
    assert "1 (extra.weight) keys of the file are not in the model" in message and "strict: false" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded

    with caplog.at_level(logging.WARNING, logger="service"):
        init_model(model, path, strict=False)
    assert "keys of the model are not in the file" in caplog.text and "extra.weight" in caplog.text
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in dropped)  # kept as the task built them
    assert all(torch.equal(after[k], v) for k, v in weights.items() if k in after)

    fresh = UNet(width=2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    every_key_and_one_more = {**source.state_dict(), "extra.weight": torch.zeros(3)}
    with pytest.raises(WeightsError) as caught:  # strict: an unexpected key alone is refused too
        load_weights(fresh, every_key_and_one_more, "more.pt")
    assert "1 (extra.weight) keys of the file are not in the model" in str(caught.value)
    assert "keys of the model are not in the file" not in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing loaded

    with pytest.raises(WeightsError, match=r"differ in shape \(enc1.0.weight \(4, 1, 3, 3\) in the file"):
        load_weights(UNet(width=2), UNet(width=4).state_dict(), "other.pt", strict=False)
    with pytest.raises(WeightsError, match="none of its 1 keys"):
        load_weights(UNet(width=2), {"x": torch.zeros(1)}, "x.pt", strict=False)


def test_init_from_refuses_a_pickle_that_holds_code_and_says_how_to_convert_it(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    whole, evil = tmp_path / "whole.pt", tmp_path / "evil.pt"
    torch.save(UNet(width=2), whole)  # the whole model object, not its state dict
    torch.save({"w": Payload()}, evil)
    for path in (whole, evil):
        with pytest.raises(WeightsError) as caught:
            read_weights(path)
        assert "Nothing in it was executed" in str(caught.value)
        assert "holds code or objects" in str(caught.value) and "torch.save(model.state_dict()" in str(caught.value)
    assert not marker.exists()
    with pytest.raises(WeightsError, match="does not exist on this node"):
        read_weights(tmp_path / "absent.pt")
    (tmp_path / "text.pt").write_text("hello, not weights")
    with pytest.raises(WeightsError, match="neither a torch file nor a safetensors file"):
        read_weights(tmp_path / "text.pt")


# Reads each file named on its command line with read_weights; prints, per file, the message and the seconds, and
# how much this process's peak RSS grew over all of them (from after torch's import).
_READ_IN_BOUNDED_MEMORY = """
import json, resource, sys, time
from pathlib import Path
from service.state.weights import WeightsError, read_weights
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = []
for name in sys.argv[1:]:
    started = time.monotonic()
    try:
        message = f"loaded {len(read_weights(Path(name)))} tensors"
    except WeightsError as exc:
        message = str(exc)
    results.append([message, time.monotonic() - started])
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps([results, grew]))
"""


@pytest.mark.e2e
def test_a_huge_file_that_holds_no_weights_is_refused_by_its_first_bytes_in_bounded_memory(tmp_path):
    """Issue 24: 1.5 GiB of zeros as init_from was read whole (on every rank) before it was refused: 1.6 GB of
    peak RSS and 6 to 14 s each. Sparse files here, so the disk holds none of it."""
    heads = {"zeros": (b"", "is neither a torch file nor a safetensors file"),
             "zip": (b"PK\x03\x04", "is not a readable torch checkpoint (PytorchStreamReader failed"),
             "pickle": (b"\x80\x02", "Refused to load"),
             "safetensors": ((2**40).to_bytes(8, "little") + b"{", "is not a readable safetensors file")}  # fmt: skip
    paths = []
    for name, (head, _) in heads.items():
        path = tmp_path / f"{name}.pt"
        with open(path, "wb") as file:
            file.write(head)
            file.truncate(int(1.5 * 2**30))
        paths.append(str(path))
    real = tmp_path / "real.pt"
    torch.save(UNet(width=2).state_dict(), real)  # and a real one still loads, through the same process
    done = subprocess.run([sys.executable, "-c", _READ_IN_BOUNDED_MEMORY, *paths, str(real)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results, grew = json.loads(done.stdout.splitlines()[-1])
    assert grew < 100 * 2**20, grew  # the old code: the file's size, 1.6 GB; now under 3 MB
    for (name, (_, needle)), (message, seconds) in zip(heads.items(), results, strict=False):
        assert needle in message, (name, message)
        assert seconds < 2, (name, seconds)  # the old code: 6 to 14 s
    assert "first bytes are b'\\x00\\x00" in results[0][0] and f"header length {2**40} is past" in results[3][0]
    assert results[-1][0] == f"loaded {len(UNet(width=2).state_dict())} tensors", results[-1]


def test_config_init_from_takes_a_path_or_a_mapping_and_best_needs_a_mode():
    assert load_config(None, ["init_from=w.pt"]).init_from.model_dump() == {"path": "w.pt", "strict": True}
    config = load_config(None, ["init_from={path: w.pt, strict: false}", "checkpoint.best={metric: dice, mode: max}"])
    assert config.init_from.strict is False and config.checkpoint.best.mode == "max"
    with pytest.raises(ConfigError, match="checkpoint.best.mode: Field required"):
        load_config(None, ["checkpoint.best={metric: loss}"])
    with pytest.raises(ConfigError, match="init_from.path must be a non-empty path"):
        load_config(None, ["init_from= "])
    assert JobConfig().init_from is None and JobConfig().checkpoint.best is None


# --- checkpoint.best ------------------------------------------------------------------------------------------------


def small_state(step: int) -> dict:
    return full_state(nn.Linear(2, 1), step)


def test_best_checkpoint_survives_pruning_and_moves_only_to_a_strictly_better_one(tmp_path):
    directory = tmp_path / "checkpoints"
    saver = Rank0Checkpointer(directory, every_steps=1, keep=2, config_hash=HASH, on_error="stop",
                              async_save=False, best_rule=BestRule("loss", "min"))  # fmt: skip
    losses = {2: 0.5, 4: 0.7, 6: 0.5, 8: 0.3}
    for step in range(1, 10):
        saver.maybe_save(step, lambda step=step: small_state(step))
        if step in losses:
            saver.on_eval(step, {"loss": losses[step], "dice": 0.1}, lambda step=step: small_state(step))
        if step == 7:
            steps = sorted(int(p.stem[5:]) for p in directory.glob("step-*.json"))
            assert steps == [2, 6, 7], "the best (step 2; step 6 only ties it) outlives keep=2"
    saver.close()
    assert read_best(directory).step == 8 and saver.best.value == 0.3
    assert sorted(p.name for p in directory.glob("step-*.pt")) == [state_name(8), state_name(9)]


def test_best_saves_the_evaluated_step_when_no_periodic_save_did_and_keeps_one_that_did(tmp_path):
    directory = tmp_path / "checkpoints"
    saver = Rank0Checkpointer(directory, every_steps=0, keep=2, config_hash=HASH, on_error="stop",
                              async_save=True, best_rule=BestRule("dice", "max"))  # fmt: skip
    calls = []

    def state():
        calls.append(1)
        return small_state(5)

    saver.on_eval(5, {"loss": 1.0, "dice": 0.4}, state)
    saver.save(5, state)  # the end of the run: step 5 is on disk already
    saver.close()
    assert len(calls) == 1 and read_best(directory).step == 5 and (directory / manifest_name(5)).exists()


def test_best_json_waits_for_the_background_save_of_its_step_and_the_step_is_written_once(tmp_path, monkeypatch):
    """checkpoint.async: step 2's periodic save is still being written when its evaluation makes it the best. The
    pointer must not name it before it is on disk, and the evaluation must not write it a second time."""
    directory = tmp_path / "checkpoints"
    real_write = checkpoint_module.write_checkpoint
    writes: list[int] = []
    writing, release = threading.Event(), threading.Event()

    def held_write(where, step, *args, **kwargs):
        writes.append(step)
        if len(writes) == 1:  # the background save: held open until the test lets it finish
            writing.set()
            assert release.wait(30), "the test never released the background write"
        return real_write(where, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "write_checkpoint", held_write)
    saver = Rank0Checkpointer(directory, every_steps=2, keep=2, config_hash=HASH, on_error="stop", async_save=True,
                              best_rule=BestRule("loss", "min"))  # fmt: skip
    try:
        saver.maybe_save(2, lambda: small_state(2))
        assert writing.wait(10)  # the writer thread is inside its write of step 2
        evaluation = threading.Thread(target=saver.on_eval, args=(2, {"loss": 0.5}, lambda: small_state(2)))
        evaluation.start()
        evaluation.join(0.5)
        assert evaluation.is_alive()  # it waits for that save
        assert not (directory / BEST_NAME).exists() and not (directory / manifest_name(2)).exists()
    finally:
        release.set()
    evaluation.join(10)
    saver.close()
    assert not evaluation.is_alive() and read_best(directory).step == 2 and saver.best.step == 2
    assert (directory / manifest_name(2)).exists() and (directory / state_name(2)).exists()
    assert writes == [2], "the best step was written again instead of waiting for its background save"


@pytest.mark.parametrize(("mode", "worst"), [("min", float("-inf")), ("max", float("inf"))])
def test_an_infinite_or_nan_metric_never_becomes_the_best(tmp_path, mode, worst):
    """An eval that diverged (inf, or nan) is no improvement, however the metric ranks: the best stays a real one."""
    rule = BestRule("loss", mode)
    assert not rule.improves(worst, None) and not rule.improves(float("nan"), None) and rule.improves(0.5, None)
    directory = tmp_path / "checkpoints"
    saver = Rank0Checkpointer(directory, 0, 2, HASH, "stop", False, best_rule=rule)
    for step, value in ((2, worst), (4, 0.5), (6, worst), (8, float("nan"))):
        saver.on_eval(step, {"loss": value}, lambda step=step: small_state(step))
    saver.close()
    assert read_best(directory).step == 4 and saver.best.value == 0.5
    assert sorted(path.name for path in directory.glob("step-*.json")) == [manifest_name(4)]  # nothing else saved


def test_an_unknown_best_metric_fails_on_every_rank_naming_the_metrics_that_exist(tmp_path):
    rule = BestRule("acc", "max")
    for saver in (Checkpointer(rule), Rank0Checkpointer(tmp_path, 1, 2, HASH, "stop", False, best_rule=rule)):
        with pytest.raises(BestMetricError, match=r"reports only dice, loss\. Set checkpoint.best.metric"):
            saver.check_metrics(["loss", "dice"])  # before training: the names the evaluation will report
        with pytest.raises(BestMetricError, match=r"reports only dice, loss\. Set checkpoint.best.metric"):
            saver.on_eval(1, {"loss": 1.0, "dice": 0.5}, lambda: small_state(1))
        with pytest.raises(BestMetricError, match="reports no evaluation"):
            saver.check_metrics([])
    Checkpointer(rule).check_metrics(["loss", "acc"])
    Checkpointer().check_metrics([])
    assert not list(tmp_path.iterdir())


def test_a_resume_carries_the_best_so_far_on_and_a_failed_pointer_write_keeps_the_old_best(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    rule = BestRule("loss", "min")
    first = Rank0Checkpointer(directory, 2, 2, HASH, "continue", False, best_rule=rule)
    for step in (2, 4):
        first.maybe_save(step, lambda step=step: small_state(step))
    first.on_eval(2, {"loss": 0.2}, lambda: small_state(2))
    first.on_eval(4, {"loss": 0.9}, lambda: small_state(4))

    resumed = Rank0Checkpointer(directory, 2, 2, HASH, "continue", False, saved_step=4, lineage=first.lineage,
                                best_rule=rule)  # fmt: skip
    assert resumed.best is not None and resumed.best.step == 2 and resumed.best.value == 0.2
    for step in (6, 8):
        resumed.maybe_save(step, lambda step=step: small_state(step))
    resumed.on_eval(8, {"loss": 0.5}, lambda: small_state(8))  # better than this start's evals, not than step 2
    assert read_best(directory).step == 2 and (directory / state_name(2)).exists()

    def replace_fails(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("service.state.best.os.replace", replace_fails)  # the disk fills as the pointer is renamed
    resumed.on_eval(8, {"loss": 0.1}, lambda: small_state(8))
    monkeypatch.undo()
    assert read_best(directory).step == 2 and (directory / state_name(2)).exists()  # old best, never none
    assert resumed.failures == 1 and not list(directory.glob(f".{BEST_NAME}*"))

    stranger = Rank0Checkpointer(directory, 2, 2, HASH, "stop", False, saved_step=8, lineage="another-run",
                                 best_rule=rule)  # fmt: skip
    assert stranger.best is None  # another lineage's best is not this run's best so far
    assert json.loads((directory / BEST_NAME).read_text())["lineage"] == first.lineage
