"""Every bad input of issue 10 (point 7) is refused before training, naming the value and the fix.

One table; each row runs the real entrypoint: ``ddp-service validate``/``env``
in-process where the error comes before torch, a real ``python -m service
train`` subprocess where it needs the task, the run_dir or the launcher.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env

from service.cli import main
from service.hostlist import HostlistError, expand_hostlist

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


def latin1_file(tmp_path: Path) -> str:
    path = tmp_path.with_name("job.yaml")
    path.write_bytes("run_dir: runs/caf\xe9\n".encode("latin-1"))
    return str(path)


def read_only_dir(tmp_path: Path, request) -> Path:
    root = request.getfixturevalue("small_fs")()
    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
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


@pytest.mark.parametrize(("provoke", "code", "needles"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
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
