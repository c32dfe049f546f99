"""Process-tree helpers for tests and benchmarks: torchrun starts workers in sessions of their own."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid``, read from /proc (no psutil needed)."""
    children, found, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid``'s process group and every descendant's group, collected first.

    Killing torchrun's group alone would leave its workers running.
    """
    for target in [pid, *descendants(pid)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _started(pid: int) -> tuple[int, int]:
    """(start time in clock ticks after boot, pid): the order processes were made in."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]), pid
    except (OSError, IndexError, ValueError):
        return 1 << 62, pid


def worker_pids(agent_pid: int) -> dict[int, int]:
    """LOCAL_RANK → pid of a torchrun agent's worker processes.

    A worker torchrun started as a process has LOCAL_RANK in its environment; one forked by ``ddp-service
    launch``'s fork server gets it set after the fork (not in /proc's copy): those are taken in the order the
    agent started them, local rank 0 first. A worker's own children (its data loader's workers) inherit its
    LOCAL_RANK: of the processes that carry one, the first started is the worker.
    """
    _, forked = fork_server_workers(agent_pid)
    if forked:
        return dict(enumerate(sorted(forked, key=_started)))
    workers = {}
    for pid in descendants(agent_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"LOCAL_RANK="):
                local_rank = int(item.split(b"=", 1)[1])
                if local_rank not in workers or _started(pid) < _started(workers[local_rank]):
                    workers[local_rank] = pid
    return workers


def fork_server_workers(agent_pid: int) -> tuple[int, list[int]]:
    """(the fork server's pid, its children: the workers) under ``ddp-service launch``'s agent; (0, []) before."""
    children = _children_map()
    for child in children.get(agent_pid, []):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            return child, sorted(children.get(child, []))
    return 0, []


def dead_pid() -> int:
    """A process id that no process holds: the highest one free below the kernel's pid_max (found in /proc, no
    process started; the kernel hands pids out upwards from the last one and wraps long before it)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 300, -1):
        if not Path(f"/proc/{pid}").exists():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return pid
    raise RuntimeError("no free process id below pid_max")


def exit_after(seconds: float, code: int) -> None:
    """A child process's target: sleep, then exit with ``code``."""
    import sys
    import time

    time.sleep(seconds)
    sys.exit(code)
