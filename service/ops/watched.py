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
import functools
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


def parse_cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, Path]]:
    """From ``/proc/self/mountinfo``'s text, where the cgroup hierarchies a freeze is read from are mounted: ``"2"``
    for cgroup v2 (at ``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid host), ``"freezer"`` for cgroup
    v1's freezer (``docker pause`` on a v1 host); each as (the hierarchy's path mounted there, the mount point)."""
    mounts: dict[str, tuple[str, Path]] = {}
    for line in mountinfo.splitlines():
        fields, _, fs = line.partition(" - ")
        parts, fs_parts = fields.split(), fs.split()
        if len(parts) < 5 or len(fs_parts) < 3:
            continue
        if fs_parts[0] == "cgroup2":
            mounts.setdefault("2", (parts[3], Path(parts[4])))
        elif fs_parts[0] == "cgroup" and "freezer" in fs_parts[2].split(","):
            mounts.setdefault("freezer", (parts[3], Path(parts[4])))
    return mounts


@functools.cache
def cgroup_mounts() -> dict[str, tuple[str, Path]]:
    """This machine's :func:`parse_cgroup_mounts` (read once)."""
    try:
        return parse_cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return {}


def cgroup_dir(hierarchy: str, path: str, mounts: dict[str, tuple[str, Path]] | None = None) -> Path | None:
    """The directory of cgroup ``path`` (as ``/proc/PID/cgroup`` names it) in ``hierarchy`` of ``mounts`` (this
    machine's :func:`cgroup_mounts` by default), or None where that hierarchy is not mounted or that cgroup lies
    outside its mount."""
    mount = (cgroup_mounts() if mounts is None else mounts).get(hierarchy)
    if mount is None:
        return None
    root, point = mount
    relative = os.path.relpath(path, root)
    return None if relative.startswith("..") else point / relative


def _frozen(pid: int) -> bool:
    """The process's cgroup is frozen: by cgroup v2's ``cgroup.freeze`` (its own or an ancestor's), or by cgroup
    v1's freezer (where a frozen process does not even die of SIGKILL until it is thawed)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        with contextlib.suppress(OSError):
            if number == "0" and not controllers and (where := cgroup_dir("2", path)) is not None:
                if "frozen 1" in (where / "cgroup.events").read_text().splitlines():
                    return True
                if (where / "cgroup.freeze").read_text().strip() == "1":
                    return True  # freezing: it answers nothing either
            elif "freezer" in controllers.split(",") and (where := cgroup_dir("freezer", path)) is not None:
                if (where / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING"):
                    return True
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
        forget_server()


def forget_server(reap_seconds: float = 1.0) -> None:
    """multiprocessing's ``ForkServer._stop`` (close its liveness pipe, reap it, forget its socket) without its
    unbounded wait: a fork server frozen by cgroup v1's freezer does not die of SIGKILL until it is thawed, and the
    agent must not wait for that. Not reaped within ``reap_seconds``, it stays the agent's zombie once it dies."""
    server = forkserver._forkserver
    with server._lock:  # type: ignore[attr-defined]
        pid = server._forkserver_pid  # type: ignore[attr-defined]
        if pid is None:
            return
        with contextlib.suppress(OSError, TypeError):
            os.close(server._forkserver_alive_fd)  # type: ignore[attr-defined]
        deadline = time.monotonic() + reap_seconds
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                    break
            except ChildProcessError:
                break
            time.sleep(0.02)
        address = server._forkserver_address  # type: ignore[attr-defined]
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None  # type: ignore


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
