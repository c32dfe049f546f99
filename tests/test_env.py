"""The launcher contract: one table of good environments, one of bad values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, child_env
from hypothesis import given, settings
from hypothesis import strategies as st

from service.world.env import EnvError, WorldInfo, detect_world, expand_hostlist

TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_USE_AGENT_STORE": "True",
}  # fmt: skip
SRUN = {
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu-[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
}  # fmt: skip
PYTORCHJOB = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
              "PET_NPROC_PER_NODE": "1", "PET_NNODES": "2"}  # fmt: skip


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, WorldInfo("torchrun", 5, 1, 8, 4, 1, "10.0.0.1", 29500, 2, 3, "job-7", True)),
        (SRUN, WorldInfo("slurm", 3, 1, 4, 2, 1, "gpu-01", 15000 + 4242, 0, 0, "4242", False, "slurm")),
        (
            {**SRUN, "MASTER_PORT": "1234"},
            WorldInfo("slurm", 3, 1, 4, 2, 1, "gpu-01", 1234, 0, 0, "4242", False, "slurm"),
        ),
        # torchrun started by srun: torchrun's variables win, and Slurm is the scheduler around it.
        (
            {**SRUN, **TORCHRUN},
            WorldInfo("torchrun", 5, 1, 8, 4, 1, "10.0.0.1", 29500, 2, 3, "job-7", True, scheduler="slurm"),
        ),
        # Plain python in an salloc shell: a world of one, inside a Slurm job.
        ({"SLURM_JOB_ID": "7"}, WorldInfo("none", master_addr="127.0.0.1", scheduler="slurm")),
        ({"SLURM_JOB_ID": " "}, WorldInfo("none", master_addr="127.0.0.1")),
        (PYTORCHJOB, WorldInfo("pytorchjob", 1, 0, 2, 1, 1, "job-master-0", 23456)),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            WorldInfo("env", 0, 0, 2, 1, 0, "h", 1),
        ),
        ({}, WorldInfo("none", master_addr="127.0.0.1")),
        ({"PATH": "/bin"}, WorldInfo("none", master_addr="127.0.0.1")),
    ],
    ids=[
        "torchrun",
        "srun",
        "srun-port",
        "torchrun-in-srun",
        "salloc",
        "blank-job-id",
        "pytorchjob",
        "env",
        "none",
        "unrelated",
    ],  # fmt: skip
)
def test_detects(env, expected):
    assert detect_world(env) == expected


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({**TORCHRUN, "RANK": "x"}, ["RANK", "'x'", "not an integer"]),
        ({**TORCHRUN, "WORLD_SIZE": "2.5"}, ["WORLD_SIZE", "'2.5'", "not an integer"]),
        ({**TORCHRUN, "RANK": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
        ({**TORCHRUN, "RANK": "-1"}, ["RANK", "negative"]),
        ({key: v for key, v in TORCHRUN.items() if key != "MASTER_ADDR"}, ["MASTER_ADDR", "8 processes"]),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "1 to 65535"]),
        ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, ["WORLD_SIZE", "at least 1"]),
        ({**SRUN, "SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "SLURM_NTASKS=4"]),
        ({**SRUN, "SLURM_NTASKS": "four"}, ["SLURM_NTASKS", "'four'"]),
        ({**SRUN, "SLURM_JOB_NODELIST": "gpu-[01-02"}, ["gpu-[01-02", "unclosed"]),
        ({**SRUN, "SLURM_TASKS_PER_NODE": "two"}, ["SLURM_TASKS_PER_NODE", "'two'"]),
        ({**PYTORCHJOB, "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "8"}, ["PET_NPROC_PER_NODE='4'", "torchrun"]),
        ({**PYTORCHJOB, "PET_NPROC_PER_NODE": "auto"}, ["PET_NPROC_PER_NODE='auto'", "torchrun"]),
        ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR"]),
    ],
)
def test_bad_values_name_the_variable(env, names):
    with pytest.raises(EnvError) as info:
        detect_world(env)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n[1-2]", ["n1", "n2"]),
        ("gpu-[01-04,07],cpu1", ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "cpu1"]),
        ("node7", ["node7"]),
        ("a[9-10]", ["a9", "a10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ],
)
def test_expand_hostlist(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.e2e
def test_env_command_prints_detected_world_as_json():
    out = subprocess.run([sys.executable, "-m", "service", "env"], cwd=REPO, env=child_env(**SRUN),
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    data = json.loads(out)
    assert data["launcher"] == "slurm" and data["rank"] == 3 and data["master_addr"] == "gpu-01"
    assert data["scheduler"] == "slurm"


@pytest.mark.e2e
def test_env_command_reports_bad_value():
    proc = subprocess.run([sys.executable, "-m", "service", "env"], cwd=REPO,
                          env=child_env(**{**SRUN, "SLURM_PROCID": "9"}), capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert "SLURM_PROCID=9" in proc.stderr


@settings(max_examples=200, deadline=None)
@given(job_id=st.integers(min_value=0, max_value=2**32))
def test_slurms_default_port_lies_below_the_ephemeral_range(job_id):
    """Rank 0 listens on it after its imports: an ephemeral port could be an outgoing connection's by then."""
    port = detect_world({**SRUN, "SLURM_JOB_ID": str(job_id)}).master_port
    assert 15000 <= port < 32768
