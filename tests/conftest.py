"""Shared helpers: run the real service under a real torchrun, and fail (not skip) missing tools in CI."""

from __future__ import annotations

import ctypes
import json
import multiprocessing.process
import os
import posix
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from procs import kill_tree

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"

# Small, quiet, fast: every e2e job starts from these and overrides what it tests.
QUICK = (
    "train.progress_bar=false",
    "train.log_every=5",
    "metrics.tensorboard=false",
    "checkpoint.every_steps=0",
)


@pytest.fixture(scope="session", autouse=True)
def stale_snapshot_areas_removed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end, remove the in-memory snapshot areas that this worker's tests left stale: tests SIGKILL agents on
    purpose, and a killed agent cannot clean up its area in /dev/shm, where it would hold shared memory for good
    (about ten per run of the suite). Only areas whose agent is gone (doctor's rule) and whose run_dir lies under
    this worker's temporary directory."""
    yield
    import socket

    from service.config import CheckpointConfig
    from service.ops.doctor_checks import agent_gone
    from service.state.snapshot import list_areas, read_owner

    mine, host = tmp_path_factory.getbasetemp().resolve(), socket.gethostname()
    try:
        areas = list_areas(CheckpointConfig().snapshot_dir)
    except OSError:
        return
    for area in areas:
        try:
            owner = read_owner(area)
        except (OSError, ValueError):
            continue
        run_dir = owner.get("run_dir")
        if isinstance(run_dir, str) and Path(run_dir).resolve().is_relative_to(mine) and agent_gone(area, owner, host):
            shutil.rmtree(area, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most real-process (e2e) tests run first, each file's tests in their own order.

    ``make test`` hands whole files to two workers (``--dist loadfile``) in collection order, so a heavy
    file collected last (the Slurm or resume files, alphabetically late) ran alone at the end while the
    other worker idled. Longest first keeps both busy to the end. (The Makefile passes --no-loadscope-reorder:
    xdist would otherwise hand files out by their number of tests, most first, whatever this order says.)
    """

    def path(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    weight: dict[str, int] = {}
    for item in items:
        weight[path(item)] = weight.get(path(item), 0) + (item.get_closest_marker("e2e") is not None)
    order = {name: index for index, name in enumerate(dict.fromkeys(path(item) for item in items))}
    items.sort(key=lambda item: (-weight[path(item)], order[path(item)]))


class ProcessStartRefused(RuntimeError):
    """A test without the ``e2e`` marker tried to start a process."""


def _refused(original: Callable[..., object], what: str) -> Callable[..., object]:
    def refuse(*args: object, **kwargs: object) -> object:
        raise ProcessStartRefused(
            f"This test starts a process ({what}) but has no e2e marker: mark it @pytest.mark.e2e (or its module: "
            'pytestmark = pytest.mark.e2e), so that the quick tier (make test-quick, -m "not e2e") leaves it out.'
        )

    # Pickled by the original's name (a test pickles os.system as a payload it must never run).
    refuse.__module__, refuse.__qualname__ = original.__module__, original.__qualname__
    return refuse


# Every way a test starts a process: subprocess (run, check_output, asyncio's subprocesses), multiprocessing's
# and torch's processes (DataLoader workers, spawn), and the os calls beneath them (os's names are posix's).
_PROCESS_STARTS = [
    ((subprocess.Popen,), "_execute_child", "subprocess.Popen"),
    ((multiprocessing.process.BaseProcess,), "start", "multiprocessing.Process.start"),
    *(((os, posix), name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")),
]


@contextmanager
def processes_refused() -> Iterator[None]:
    """While inside, every process start raises ProcessStartRefused naming the e2e marker."""
    saved = [(owners, name, getattr(owners[0], name)) for owners, name, _ in _PROCESS_STARTS]
    try:
        for (owners, name, what), (_, _, original) in zip(_PROCESS_STARTS, saved, strict=True):
            refuse = _refused(original, what)
            for owner in owners:
                setattr(owner, name, refuse)
        yield
    finally:
        for owners, name, original in saved:
            for owner in owners:
                setattr(owner, name, original)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test without the e2e marker may start no process (nor may its fixtures), in every run: the quick tier
    (``-m "not e2e"``) then holds only in-process tests, and a test that starts one unmarked fails, naming the
    marker."""
    if item.get_closest_marker("e2e") is not None:
        yield
        return
    with processes_refused():
        yield


def require_tool(name: str, why: str = "`make test` installs the test dependencies.") -> str:
    """Path of an executable (this venv's first); a skip that says why, or a failure under CI=true."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        message = f"The {name} command is missing; {why}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment without launcher variables, so the child detects only what we pass."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TORCHELASTIC_", "SLURM_", "PET_"))
        and key
        not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
    }
    paths = [str(REPO), str(REPO / "tests" / "tasks"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


# How a test's job starts its workers. Each new interpreter imports torch and DDP's torch._dynamo (about 2.7 s of
# CPU), so a test that is not about the start itself takes the cheapest start that still runs what it checks:
# - "cold": ``torchrun -m service train``, every worker a new interpreter (the start users get from torchrun);
# - "warm": ``ddp-service launch``, the same torchrun agent, its workers forked from a fork server that imported
#   torch, torch._dynamo and the service once (a restart is a fork too): for 2 processes one import instead of two;
# - "alone": ``python -m service train``, no launcher: one process, a world of one (nproc 1; no torchrun agent and
#   its own import of torch), for single-rank checks that do not need torchrun.
STARTS = ("cold", "warm", "alone")


def torchrun_cmd(nproc: int, *overrides: str, config: str | None = None, launcher: tuple[str, ...] = (),
                 start: str = "cold") -> list[str]:  # fmt: skip
    """The command of a job of ``nproc`` processes started ``start``ed (:data:`STARTS`); ``launcher``: torchrun's
    options (default ``--standalone``)."""
    if start == "cold":
        cmd = [sys.executable, "-m", "torch.distributed.run", *(launcher or ("--standalone",)),
               f"--nproc_per_node={nproc}", "-m", "service", "train"]  # fmt: skip
    elif start == "warm":
        cmd = [sys.executable, "-m", "service", "launch", *(launcher or ("--standalone",)), f"--nproc-per-node={nproc}"]
    elif start == "alone" and nproc == 1 and not launcher:
        cmd = [sys.executable, "-m", "service", "train"]
    else:
        raise ValueError(f"start={start!r} with nproc={nproc} and launcher={launcher}: use one of {STARTS}, "
                         "and 'alone' with nproc=1 and no torchrun options.")  # fmt: skip
    if config:
        cmd.append(config)
    for override in (*QUICK, *overrides):
        cmd += ["--set", override]
    return cmd


def run_job(run_dir: Path, nproc: int, *overrides: str, config: str | None = None, start: str = "cold",
            timeout: float = 180, expect_ok: bool = True, **env: str) -> subprocess.CompletedProcess:  # fmt: skip
    """One real job (started as ``start`` says: :data:`STARTS`); returns the finished process (stdout+stderr in
    .stdout)."""
    cmd = torchrun_cmd(nproc, f"run_dir={run_dir}", *overrides, config=config, start=start)
    with subprocess.Popen(cmd, cwd=REPO, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            output, _ = proc.communicate()
            pytest.fail(f"torchrun did not finish in {timeout} s:\n{output[-6000:]}")
    finished = subprocess.CompletedProcess(cmd, proc.returncode, output)
    if expect_ok and finished.returncode != 0:
        pytest.fail(f"torchrun exited {finished.returncode}:\n{output[-6000:]}")
    return finished


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session=True and everything below it."""
    kill_tree(proc.pid)


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(run_dir: Path) -> dict:
    import torch

    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert checkpoints, f"no checkpoint under {run_dir}"
    return torch.load(checkpoints[-1], weights_only=True)["model"]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """A factory that mounts a 1 MiB tmpfs (optionally with few inodes); everything is unmounted after."""
    if os.geteuid() != 0:
        message = "mounting a small tmpfs for the disk-full tests needs root"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    mounted: list[Path] = []

    def mount(inodes: int | None = None, size: str = "1m") -> Path:
        target = tmp_path / f"fs{len(mounted)}"
        target.mkdir()
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        try:
            _mount(b"tmpfs", target, b"tmpfs", 0, options)
        except OSError as error:
            message = f"cannot mount a tmpfs at {target}: {error}"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)
        mounted.append(target)
        return target

    try:
        yield mount
    finally:
        for target in reversed(mounted):
            try:
                _umount(target, 0)
            except OSError:
                _umount(target, _MNT_DETACH)


# mount(2) and umount2(2) called in this process (no mount(8) process: the disk-full tests stay in the quick tier).
_MS_RDONLY, _MS_REMOUNT, _MNT_DETACH = 1, 32, 2


def _libc_call(name: str, *args: object) -> None:
    function = getattr(ctypes.CDLL(None, use_errno=True), name)
    if function(*args) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{name}: {os.strerror(number)}")


def _mount(source: bytes | None, target: Path, kind: bytes | None, flags: int, options: str | None) -> None:
    data = options.encode() if options is not None else None
    _libc_call("mount", source, os.fsencode(target), kind, ctypes.c_ulong(flags), data)


def _umount(target: Path, flags: int) -> None:
    _libc_call("umount2", os.fsencode(target), flags)


def remount_read_only(target: Path) -> None:
    """``mount -o remount,ro TARGET``, in this process."""
    _mount(None, target, None, _MS_REMOUNT | _MS_RDONLY, None)


def fill(root: Path, leave: int) -> None:
    """A ballast file that leaves about ``leave`` bytes free."""
    with open(root / "ballast", "wb") as file:
        file.write(b"\0" * max(0, shutil.disk_usage(root).free - leave))
        file.flush()
        os.fsync(file.fileno())
    assert shutil.disk_usage(root).free <= leave + 8192


@pytest.fixture
def cpu_burner() -> Iterator[Callable[[], None]]:
    """Start (on call) a process that keeps one core busy for the rest of the test: recovery under load."""
    procs: list[subprocess.Popen] = []

    def start() -> None:
        procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
