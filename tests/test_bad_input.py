"""Every bad input of issue 10 (point 7) is refused before training, naming the value and the fix.

One table; each row runs the real entrypoint: ``ddp-service validate``/``env``
in-process where the error comes before torch, a real ``python -m service
train`` subprocess where it needs the task, the run_dir or the launcher.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env, remount_read_only

from service.cli import main
from service.config import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_VALUES
from service.state.checkpoint_io import state_name
from service.world.hostlist import HostlistError, expand_hostlist

SLURM_BATCH = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]",
               "SLURM_TASKS_PER_NODE": "2(x2)"}  # fmt: skip
TORCH_PAIR = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29999"}  # fmt: skip


def in_process(capsys, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    code = main(argv, env=env or {})
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def train(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """A real ``python -m service train`` (one process); returns the exit code and the whole output."""
    cmd = [sys.executable, "-m", "service", "train", "--set", f"run_dir={run_dir}"]
    for override in (*QUICK, "train.max_steps=2", *overrides):
        cmd += ["--set", override]
    done = subprocess.run(
        cmd, check=False, cwd=REPO, env=child_env(**(env or {})), capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


@dataclasses.dataclass(frozen=True)
class Limited:
    code: int
    output: str
    seconds: float
    peak_rss: int  # bytes, of this child alone (os.wait4), not the maximum over every child the tests ran


# Starts the capped child and reports its rusage. A child forked from the pytest process would count that
# process's resident pages (torch, models of earlier tests) in its ru_maxrss, up to the exec: measured from this
# small intermediary, the peak is the service's own.
_LIMITED = """
import json, os, resource, subprocess, sys, time
memory, timeout, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
with open(out, "wb") as output:
    proc = subprocess.Popen(sys.argv[4:], stdout=output, stderr=subprocess.STDOUT, preexec_fn=cap)
started = time.monotonic()
while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
        break
    if time.monotonic() - started > timeout:
        proc.kill()
        _, status, usage = os.wait4(proc.pid, 0)
        break
    time.sleep(0.02)
print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024]))
"""


def run_limited(args: list[str], timeout: float = 60, memory: int = 1 << 30) -> Limited:
    """``python -m service ARGS`` with its address space capped at ``memory`` and killed after ``timeout``.

    The cap turns a config that expands without bound into a MemoryError in
    the child instead of a machine out of memory; the kill turns a hang into
    a failed test instead of a stuck suite.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", _LIMITED, str(memory), str(timeout), str(out), sys.executable,
                               "-m", "service", *args], cwd=REPO, env=child_env(), capture_output=True, text=True,
                              timeout=timeout + 30, check=True)  # fmt: skip
        seconds = time.monotonic() - started
        code, peak = json.loads(done.stdout)
        return Limited(code, out.read_bytes().decode(errors="replace"), seconds, peak)


def latin1_file(tmp_path: Path) -> str:
    path = tmp_path.with_name("job.yaml")
    path.write_bytes("run_dir: runs/caf\xe9\n".encode("latin-1"))
    return str(path)


def yaml_file(tmp_path: Path, text: str) -> str:
    path = tmp_path.with_name("job.yaml")
    path.write_text(text)
    return str(path)


def read_only_dir(tmp_path: Path, request) -> Path:
    root = request.getfixturevalue("small_fs")()
    remount_read_only(root)
    return root


# (id, how to provoke it, exit code, substrings that name the value and the fix)
CASES = [
    (
        "config-not-utf8",
        lambda c, t, r: in_process(c, ["validate", latin1_file(t)]),
        2,
        ["job.yaml", "not UTF-8", "0xe9", "save the file as UTF-8"],
    ),
    (
        "lr-inf",
        lambda c, t, r: in_process(c, ["validate", "--set", "train.lr=.inf"]),
        2,
        ["train.lr", "got inf", "finite number", "such as 0.05"],
    ),
    (
        "lr-nan",
        lambda c, t, r: in_process(c, ["validate", "--set", "train.lr=.nan"]),
        2,
        ["train.lr", "got nan", "finite number"],
    ),
    (
        "lr-1e400",  # YAML reads 1e400 (no dot) as a string; pydantic parsed it to inf after the check had run
        lambda c, t, r: in_process(c, ["validate", "--set", "train.lr=1e400"]),
        2,
        ["train.lr", "got '1e400'", "finite number", "such as 0.05"],
    ),
    (
        "grad-clip-infinity",
        lambda c, t, r: in_process(c, ["validate", "--set", "train.grad_clip=Infinity"]),
        2,
        ["train.grad_clip", "got 'Infinity'", "finite number"],
    ),
    (
        "weight-decay-inf-in-a-file",
        lambda c, t, r: in_process(c, ["validate", yaml_file(t, "train:\n  weight_decay: inf\n")]),
        2,
        ["job.yaml", "train.weight_decay", "got 'inf'", "finite number"],
    ),
    (
        "timeout-1e14",
        lambda c, t, r: in_process(c, ["validate", "--set", "dist.timeout_seconds=1.0e+14"]),
        2,
        ["dist.timeout_seconds", "100000000000000", "between 1 and 604800"],
    ),
    (
        "seed-1e23",
        lambda c, t, r: in_process(c, ["validate", "--set", "seed=1.0e+23"]),
        2,
        ["seed", "1e+23", "between 0 and 4294967295"],
    ),
    (
        "metrics-port-past-65535",
        lambda c, t, r: in_process(c, ["train", "--set", "metrics.port=65535"], TORCH_PAIR),
        2,
        ["metrics.port=65535", "2 processes", "port 65536", "at most 65534"],
    ),
    (
        "task-raises-at-import",
        lambda c, t, r: train(t, "task=broken_tasks:raises", env={"BROKEN_TASK_AT_IMPORT": "raise"}),
        1,
        ["TaskError", "'broken_tasks'", "RuntimeError: the dataset server is unreachable", "Fix the module"],
    ),
    (
        "task-exits-at-import",
        lambda c, t, r: train(t, "task=broken_tasks:raises", env={"BROKEN_TASK_AT_IMPORT": "exit"}),
        1,
        ["TaskError", "'broken_tasks'", "sys.exit(3)", "Fix the module"],
    ),
    (
        "task-build-raises",
        lambda c, t, r: train(t, "task=broken_tasks:raises"),
        1,
        ["TaskError", "'broken_tasks:raises'", "KeyError: 'image_size'", "Fix the function"],
    ),
    (
        "task-build-exits",
        lambda c, t, r: train(t, "task=broken_tasks:exits"),
        1,
        ["TaskError", "'broken_tasks:exits'", "sys.exit('no GPU, giving up')"],
    ),
    (
        "run-dir-is-a-file",
        lambda c, t, r: (t.write_text("x"), train(t))[1],
        1,
        ["RunDirError", "is a file, not a directory", "Point run_dir at a directory"],
    ),
    (
        "run-dir-read-only",
        lambda c, t, r: train(read_only_dir(t.parent, r)),
        1,
        ["RunDirError", "Read-only file system", "point run_dir at a", "nothing was trained"],
    ),
    (
        "rank-without-world-size",
        lambda c, t, r: in_process(c, ["train"], {"RANK": "1"}),
        2,
        ["RANK='1'", "WORLD_SIZE is not", "Set WORLD_SIZE too"],
    ),
    (
        "slurm-batch-step-without-srun",
        lambda c, t, r: in_process(c, ["train"], SLURM_BATCH),
        2,
        ["SLURM_NTASKS=4", "SLURM_STEP_ID is not", "batch script", "srun python -m service train"],
    ),
]


# The cases that run a real `python -m service train` (a process): e2e.
PROCESS_CASES = {"task-raises-at-import", "task-exits-at-import", "task-build-raises", "task-build-exits",
                 "run-dir-is-a-file", "run-dir-read-only"}  # fmt: skip


@pytest.mark.parametrize(
    ("provoke", "code", "needles"),
    [pytest.param(*case[1:], id=case[0], marks=[pytest.mark.e2e] * (case[0] in PROCESS_CASES)) for case in CASES],
)
def test_bad_input_is_refused_before_training_naming_value_and_fix(provoke, code, needles, capsys, tmp_path, request):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    got, output = provoke(capsys, run_dir, request)
    assert got == code, output[-3000:]
    for needle in needles:
        assert needle in output, f"{needle!r} missing from:\n{output[-3000:]}"
    assert " INFO step " not in output and not (run_dir.is_dir() and (run_dir / "checkpoints").exists())
    assert time.monotonic() - started < 60


def test_huge_slurm_node_list_gives_the_first_host_at_once_and_is_never_expanded(capsys):
    """``n[0-99999999]`` used to expand 10**8 names: MASTER_ADDR needs only the first, the count needs none."""
    env = {**SLURM_BATCH, "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[0-99999999],m1", "SLURM_TASKS_PER_NODE": "1"}
    started = time.monotonic()
    code, output = in_process(capsys, ["env"], env)
    assert code == 0 and '"master_addr": "n0"' in output, output
    assert time.monotonic() - started < 1.0
    with pytest.raises(HostlistError, match=r"names 100000001 hosts, more than the 100000"):
        expand_hostlist("n[0-99999999],m1")
    with pytest.raises(HostlistError, match=r"bad range '9-1'"):
        expand_hostlist("n[9-1]")


def alias_bomb(levels: int = 9) -> str:
    """About 1 KB of YAML that expands to 9**levels mappings: each level names the one before nine times."""
    lines = ["task_options:", "  a0: &a0 {k0: 1, k1: 2, k2: 3, k3: 4, k4: 5, k5: 6, k6: 7, k7: 8, k8: 9}"]
    for level in range(1, levels + 1):
        refs = ", ".join(f"k{j}: *a{level - 1}" for j in range(9))
        lines.append(f"  a{level}: &a{level} {{{refs}}}")
    return "\n".join(lines) + "\n"


DEEP = "[" * 4000 + "]" * 4000
UNBOUNDED = [  # (id, file text or None, arguments after the file, substrings of the message)
    ("alias-bomb", alias_bomb(), [], ["job.yaml", f"more than {MAX_VALUES} keys and values", "aliases (*name)"]),
    ("alias-bomb-train", alias_bomb(), ["train"], ["job.yaml", f"more than {MAX_VALUES} keys and values"]),
    ("recursive-alias", "task_options:\n  x: &x [*x]\n", [], ["job.yaml", f"more than {MAX_DEPTH} levels deep"]),
    ("4000-levels-in-a-file", f"task_options:\n  x: {DEEP}\n", [], ["job.yaml", f"more than {MAX_DEPTH} levels",
                                                                       "line 2", "flatten task_options"]),
    ("4000-levels-in-set", None, ["--set", f"task_options.x={DEEP}"], ["--set 'task_options.x=[[[", "levels deep"]),
    ("4000-dotted-keys", None, ["--set", "task_options." + ".".join(["k"] * 4000) + "=1"],
     ["with its --set overrides nests", "levels deep"]),
    ("dev-zero-as-config", "/dev/zero", [], ["/dev/zero", f"larger than {MAX_CONFIG_BYTES} bytes"]),
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize(("text", "args", "needles"), [c[1:] for c in UNBOUNDED], ids=[c[0] for c in UNBOUNDED])
def test_unbounded_config_is_refused_fast_with_bounded_memory(tmp_path, text, args, needles):
    """Issue 15: nine levels of aliases used gigabytes; 4,000 levels gave a RecursionError (exit 1, not 2)."""
    command = args[0] if args[:1] == ["train"] else "validate"
    rest = args[1:] if command == "train" else args
    path = text if text == "/dev/zero" else (yaml_file(tmp_path, text) if text is not None else None)
    run_dir = tmp_path / "run"
    done = run_limited([command, *([path] if path else []), "--set", f"run_dir={run_dir}", *rest], timeout=60)
    assert done.code == 2, done.output[-3000:]
    for needle in needles:
        assert needle in done.output, f"{needle!r} missing from:\n{done.output[-3000:]}"
    assert "Traceback" not in done.output and not run_dir.exists()
    assert done.seconds < 15, done.seconds  # the old code was still expanding the alias bomb after 30 s
    assert done.peak_rss < 200 * 2**20, done.peak_rss  # about 35 MiB; the old code passed 2 GiB


@pytest.mark.e2e
def test_non_finite_float_is_refused_by_train_before_any_work(tmp_path):
    """The real entrypoint, train as well as validate: exit 2 and the key, the value and the fix."""
    job = yaml_file(tmp_path, "train:\n  grad_clip: 1e400\n  momentum: Infinity\n")
    run_dir = tmp_path / "run"
    for command in ("train", "validate"):
        done = run_limited([command, job, "--set", f"run_dir={run_dir}", "--set", "train.lr=-inf"], timeout=60)
        assert done.code == 2, done.output[-3000:]
        for key, value in (("train.grad_clip", "'1e400'"), ("train.momentum", "'Infinity'"), ("train.lr", "'-inf'")):
            assert f"{key}: must be a finite number" in done.output and f"(got {value})" in done.output, done.output
        assert "write a plain number such as 0.05" in done.output and not run_dir.exists()


@pytest.mark.e2e
def test_resume_skips_a_planted_fifo_and_falls_back_to_the_previous_checkpoint(tmp_path):
    """Issue 15: a FIFO at the newest step's .pt, beside its valid manifest, hung the resume (SIGTERM only set the
    preemption flag). Two real ``train`` runs; the second would hang without the fix, and train()'s timeout
    (120 s) fails the test instead."""
    run_dir = tmp_path / "run"
    code, output = train(run_dir, "checkpoint.every_steps=1")
    checkpoints = run_dir / "checkpoints"
    assert code == 0 and (checkpoints / state_name(2)).is_file(), output[-3000:]
    (checkpoints / state_name(2)).unlink()
    os.mkfifo(checkpoints / state_name(2))
    code, output = train(run_dir, "checkpoint.every_steps=1", "train.max_steps=3")
    assert code == 0, output[-3000:]
    assert f"skipping checkpoint {checkpoints / state_name(2)}: {state_name(2)} is a FIFO" in output, output[-3000:]
    assert f"resuming from {checkpoints / state_name(1)} (step 1" in output and "done: step 3" in output
    assert (checkpoints / state_name(2)).is_file()  # saved again over the FIFO, atomically


@pytest.mark.e2e
def test_an_unknown_best_metric_exits_2_on_every_rank_naming_the_metrics_that_exist(tmp_path):
    """Issue 24: `checkpoint.best` with a metric the evaluation does not report exited 1 with a traceback. Under
    launch (torchrun's agent, 2 workers): each worker logs the message alone, before any step, and launch exits 2."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "service", "launch", "--nproc-per-node=2"]
    for override in (*QUICK, f"run_dir={run_dir}", "task_options.image_size=16", "train.max_steps=2",
                     "checkpoint.best={metric: acc, mode: max}"):  # fmt: skip
        cmd += ["--set", override]
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    for rank in (0, 1):
        assert (
            f"[rank {rank}] ERROR checkpoint.best.metric is 'acc', but the evaluation reports only dice, loss. "
            "Set checkpoint.best.metric to one of those (e.g. --set checkpoint.best.metric=dice)"
        ) in output, output
    assert "Traceback" not in output and "launch: exit 2 (bad input" in output, output[-4000:]
    assert " INFO step " not in output and not (run_dir / "checkpoints").exists()
