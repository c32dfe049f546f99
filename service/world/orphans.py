"""No orphans: a worker whose torchrun agent died stops at once, with no checkpoint and no open port.

torchrun starts each worker in a session of its own, so when the agent is
SIGKILLed (OOM killer, a node drain, ``kill -9``) nothing signals the workers:
they would train on, hold their metrics ports and write checkpoints into a
run_dir that a new job may already own. Two mechanisms, either enough alone:

- ``PR_SET_PDEATHSIG`` (Linux): the kernel sends this process a signal when
  its parent *thread* exits. torchrun starts workers from its main thread, so
  that is the agent's death;
- a watchdog thread that polls ``os.getppid()`` every :data:`POLL_SECONDS`:
  it still works where prctl does not exist (macOS), where the death signal
  was cleared (a set-uid exec), and when the agent died before prctl ran.

The signal is SIGKILL, on purpose. SIGTERM is preemption
(:mod:`service.state.preemption`): rank 0 would save a checkpoint, but with the agent
gone nobody restarts the job, and the save might land in a run_dir whose lock
a newer job has taken over. SIGKILL runs no Python: no checkpoint, no summary;
the kernel closes every socket, so the ports are free at once. A checkpoint
being written at that moment stays a temporary file that the next save
deletes; the previous checkpoints stay valid (writes are atomic).

Only workers under torchrun arm it. A plain ``python -m service train``
whose shell exits (``nohup``) must go on, and ``srun`` kills its own tasks.

A worker of ``ddp-service launch`` is forked by the agent's fork server
(:mod:`service.ops.warm`), which lives as long as any worker does (each holds
the write end of its liveness pipe): the parent's death would never come. Such
a worker (``WorldInfo.agent_pid``, not its parent) watches the agent itself: a
thread waits on the agent's pidfd (``os.pidfd_open``, woken the moment it
exits), or polls it where pidfds do not exist.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import signal
import sys
import threading
from pathlib import Path

from service.world.env import WorldInfo

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel for ``sig`` when the parent exits; False where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
            return False
    except (OSError, AttributeError):
        return False
    return True


def die_now() -> None:
    """What an orphan does: end this process at once, running no Python (no checkpoint, no summary)."""
    os.kill(os.getpid(), signal.SIGKILL)


class ParentWatchdog:
    """A daemon thread that ends the process once its parent is no longer ``parent``."""

    def __init__(self, parent: int, interval: float = POLL_SECONDS, on_orphan=die_now) -> None:
        self.parent = parent
        self.interval = interval
        self.on_orphan = on_orphan
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="parent-watchdog", daemon=True)

    def start(self) -> ParentWatchdog:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            if os.getppid() != self.parent:
                print(f"the parent process {self.parent} (the torchrun agent) is gone: this worker stops now, "
                      "without a checkpoint", file=sys.stderr, flush=True)  # fmt: skip
                self.on_orphan()
                return

    def stop(self) -> None:
        self._stop.set()


class AgentWatchdog:
    """A daemon thread that ends the process once the agent (not its parent: the fork server) has exited."""

    def __init__(self, agent: int, interval: float = POLL_SECONDS, on_orphan=die_now) -> None:
        self.agent = agent
        self.interval = interval
        self.on_orphan = on_orphan
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="agent-watchdog", daemon=True)

    def start(self) -> AgentWatchdog:
        self._thread.start()
        return self

    def _gone(self) -> bool:
        try:
            os.kill(self.agent, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:  # a zombie the agent's own parent has not reaped is gone too
            return Path(f"/proc/{self.agent}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True

    def _watch(self) -> None:
        try:
            pidfd = os.pidfd_open(self.agent)
        except ProcessLookupError:
            pidfd = None
            self._report()
            return
        except (OSError, AttributeError):  # no pidfds here: poll
            pidfd = None
        try:
            while not self._stop.is_set():
                if pidfd is not None:
                    ready, _, _ = select.select([pidfd], [], [], self.interval)
                    if ready:
                        self._report()
                        return
                elif self._stop.wait(self.interval) or self._gone():
                    if not self._stop.is_set():
                        self._report()
                    return
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _report(self) -> None:
        print(f"the torchrun agent (process {self.agent}) is gone: this worker stops now, without a checkpoint",
              file=sys.stderr, flush=True)  # fmt: skip
        self.on_orphan()

    def stop(self) -> None:
        self._stop.set()


def guard_against_orphaning(world: WorldInfo) -> ParentWatchdog | AgentWatchdog | None:
    """Under torchrun, arm both mechanisms (decided once, at start); elsewhere do nothing. A worker forked by the
    agent's fork server watches the agent itself (its parent, the fork server, outlives it)."""
    if world.launcher != "torchrun":
        return None
    parent = os.getppid()  # may be 1 legitimately: torchrun as a container's first process
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the agent died between the two calls, before the kernel could tell us
        die_now()
    if world.agent_pid and world.agent_pid != parent:
        return AgentWatchdog(world.agent_pid).start()
    return ParentWatchdog(parent).start()
