"""The agent watches ``launch``'s forked workers itself, and starts them cold where the fork server cannot serve.

A worker forked by the fork server is the fork server's child, not the agent's: multiprocessing tells the agent
of its exit through the fork server, which reaps it and writes its status on a socket. A fork server that is
stopped (SIGSTOP, a debugger) or frozen (its cgroup's freezer) kept a worker's death from the agent until it ran
again (seen: 90 s, until SIGCONT), and a restart waited on it as long. So here, in the agent:

- each forked worker has a pidfd (``os.pidfd_open``), readable the moment the worker exits, whatever its parent
  does: it is the sentinel torch's agent waits on. Its exit code comes from the fork server when it answers within
  a second, or else from the worker's own zombie (``/proc/PID/stat``'s exit code, checked against the start
  time); 255 when neither knows (as multiprocessing says of a lost fork server);
- a start asks the fork server only while it runs: one that is gone, has exited, is stopped or frozen (before the
  start, or while the agent waits for its answer) is killed, with one warning naming why, the modules it preloads
  and ``--no-fork-server``, and this worker and every later one of the launch start as new interpreters
  (multiprocessing's spawn: the agent's own children, cold starts as under ``--no-fork-server``).

:func:`install` puts :func:`start` in place of multiprocessing's forkserver ``Popen`` in the agent's process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import time
from multiprocessing import forkserver, popen_forkserver, popen_spawn_posix, reduction, spawn, util
from multiprocessing.connection import wait
from multiprocessing.context import set_spawning_popen
from pathlib import Path
from typing import Any

log = logging.getLogger("service.ops.launcher")

_close_fds = util.close_fds  # type: ignore[attr-defined]
ANSWER_SECONDS = 1.0  # how long an exit's code is awaited from the fork server before the zombie is read


class ServerTrouble(Exception):
    """The fork server cannot serve a start now; the message says why."""


class _Cold:
    why: str | None = None  # set once the fork server failed: every later start is a new interpreter
    modules: tuple[str, ...] = ()


COLD = _Cold()


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3 is [0]), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _frozen(pid: int) -> bool:
    """The process's cgroup (v2) is frozen."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                events = Path("/sys/fs/cgroup", line[3:].lstrip("/"), "cgroup.events").read_text()
                return "frozen 1" in events.splitlines()
    except OSError:
        pass
    return False


def trouble(pid: int | None) -> str | None:
    """Why the fork server ``pid`` cannot answer a start now (gone, exited, stopped, frozen), or None."""
    if pid is None:
        return None  # not started yet: the start starts it
    fields = _stat(pid)
    if fields is None:
        return "is gone"
    if fields[0] in ("Z", "X"):
        return "has exited"
    if fields[0] in ("T", "t"):
        return "is stopped (SIGSTOP or a debugger)"
    if _frozen(pid):
        return "is frozen (its cgroup's freezer)"
    return None


def _server_pid() -> int | None:
    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def zombie_code(pid: int, started: str) -> int | None:
    """The exit code of ``pid`` while it is a zombie of the same start (``started``: its start time field), as
    multiprocessing gives it (-N for signal N); None when it runs, is gone, or is another process now."""
    fields = _stat(pid)
    if fields is None or fields[0] != "Z" or fields[19] != started or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


class WatchedPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver start, with the worker watched on its own pidfd (module docstring)."""

    _pidfd: int | None = None
    _server: int = -1
    _started = ""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        server = _server_pid()
        self._server, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        self.sentinel = self._server
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, _close_fds, (parent_w, self._server))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        while not wait([self._server], 0.2):  # the fork server's answer: the worker's pid
            why = trouble(server or _server_pid())
            if why is not None:
                raise ServerTrouble(why)
        self.pid = forkserver.read_signed(self._server)
        with contextlib.suppress(OSError):  # ended and reaped already: the fork server's answer tells its code
            self._pidfd = os.pidfd_open(self.pid)
            self._started = (_stat(self.pid) or [""] * 20)[19]
            self.sentinel = self._pidfd
            self.finalizer.cancel()
            self.finalizer = util.Finalize(self, _close_fds, (parent_w, self._server, self._pidfd))

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None and self._pidfd is not None:
            if not wait([self._pidfd], 0 if flag == os.WNOHANG else None):
                return None
            self.returncode = self._exit_code()
        return super().poll(flag)

    def _exit_code(self) -> int:
        deadline = time.monotonic() + ANSWER_SECONDS
        answered = True
        while True:
            if answered and wait([self._server], 0):
                try:
                    return int(forkserver.read_signed(self._server))
                except (OSError, EOFError):
                    answered = False  # the fork server is gone
            code = zombie_code(self.pid, self._started)
            if code is not None:
                return code
            if time.monotonic() > deadline or not answered:
                return 255
            time.sleep(0.01)

    def _send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)
            return
        super()._send_signal(sig)  # type: ignore[misc]


def go_cold(why: str) -> None:
    """Warn once, kill the fork server (never a user's code: it preloads torch and the service alone), and start
    every later worker as a new interpreter."""
    COLD.why = why
    pid = _server_pid()
    log.warning("launch: the fork server%s %s (it preloads %s): this worker and every later one of this launch "
                "start as new interpreters, cold, as under --no-fork-server; pass --no-fork-server to start "
                "without a fork server", f" (pid {pid})" if pid else "", why, ", ".join(COLD.modules))  # fmt: skip
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            forkserver._forkserver._stop()  # type: ignore[attr-defined]  # reaps it, forgets its socket


def start(process_obj: Any) -> Any:
    """What a forkserver ``Process.start`` runs in the agent: a watched fork, or a cold start (module docstring)."""
    if COLD.why is None:
        why = trouble(_server_pid())
        if why is None:
            try:
                return WatchedPopen(process_obj)
            except ServerTrouble as exc:
                why = str(exc)
            except (EOFError, OSError) as exc:
                why = f"failed to start a worker ({type(exc).__name__}: {exc or 'no answer'})"
        go_cold(why)
    return popen_spawn_posix.Popen(process_obj)


def install(modules: tuple[str, ...]) -> None:
    """Forkserver starts in this process (the agent) go through :func:`start`; ``modules``: the fork server's
    preload, named in the warning."""
    COLD.modules, COLD.why = modules, None
    popen_forkserver.Popen = start  # type: ignore[misc,assignment]
