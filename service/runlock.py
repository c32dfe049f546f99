"""One job per ``run_dir``: rank 0 holds ``run_dir/.lock`` for the job's life.

The lock is a file created with ``O_CREAT | O_EXCL``, which is atomic on local
file systems, on NFSv3 and later, and on Lustre. It holds who took it (host,
pid, the pid's start time, the launcher's run id, when) and its mtime is
renewed every :data:`RENEW_SECONDS` by a thread while the job runs. See
docs/resume.md, "One job per run_dir", for why ``O_EXCL`` and not ``flock``.

A lock whose holder is gone is taken over with a warning:

- on the same host: the pid is not alive (or is alive but started at another
  time: a reused pid);
- on another host: the mtime is older than :data:`STALE_AFTER` renewals.

A fresh lock of *another* job is refused with :class:`RunDirLockedError`
naming the holder. A fresh lock of the *same* run id on another host (the
previous rendezvous round's rank 0 on a node that was lost) is waited for
until it goes stale. A restart of the same job on the same host finds the
previous rank 0 dead and takes over at once; a clean exit removes the lock.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from service.config import JobConfig
from service.env import WorldInfo

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
RENEW_SECONDS = 5.0
STALE_AFTER = 6  # renewals missed before a lock on another host counts as abandoned
MIN_FREE_BYTES = 1 << 20  # below this, not even the lock, the summary and a small checkpoint fit


class RunDirError(RuntimeError):
    """``run_dir`` cannot hold this job's outputs (a file, read-only, full); the message names the fix."""


class RunDirLockedError(RunDirError):
    """Another live job holds ``run_dir``; the message names it."""


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc``), or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pid_alive(pid: int, started: str | None) -> bool:
    """Whether ``pid`` runs and, when its start time was recorded, is still that same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or process_start(pid) in (None, started)


def describe_holder(holder: dict[str, Any]) -> str:
    since = holder.get("started")
    when = (
        datetime.datetime.fromtimestamp(since).isoformat(timespec="seconds") if isinstance(since, (int, float)) else "?"
    )
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')!r}, run id {holder.get('run_id')!r}, "
            f"since {when}")  # fmt: skip


class RunDirGuard:
    """Holds nothing: every rank but 0."""

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        yield


class RunDirLock(RunDirGuard):
    def __init__(self, run_dir: Path, run_id: str | None, renew: float = RENEW_SECONDS, stale_after: int = STALE_AFTER,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self.run_id = run_id
        self.renew = renew
        self.stale_seconds = renew * stale_after
        self.clock = clock
        self.host = socket.gethostname()
        self.content = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()

    # ----------------------------------------------------------------------------- taking it

    def acquire(self) -> None:
        self._prepare_dir()
        deadline = None
        while True:
            if self._create():
                break
            holder, raw, age = self._read()
            if not raw and not self.path.exists():
                continue  # released between our create and our read
            if not holder and age < 2.0:
                time.sleep(0.1)  # its creator is between O_EXCL and the write
                continue
            reason = self._stale_reason(holder, age)
            if reason is None and holder.get("run_id") == self.run_id and self.run_id is not None \
                    and holder.get("host") != self.host:  # fmt: skip
                deadline = deadline or time.monotonic() + self.stale_seconds + self.renew
                if time.monotonic() < deadline:  # the previous round's rank 0 on a node that is gone, or going
                    log.info("run_dir lock %s is held by %s of this same run; waiting for it to go or go stale",
                             self.path, describe_holder(holder))  # fmt: skip
                    time.sleep(min(self.renew, 1.0))
                    continue
                reason = f"its heartbeat did not stop within {self.stale_seconds:.0f} s"
            if reason is None:
                raise RunDirLockedError(
                    f"run_dir {self.run_dir} is in use by another job: {describe_holder(holder)} holds {self.path} "
                    f"(renewed {age:.0f} s ago). Two jobs in one run_dir would overwrite each other's checkpoints "
                    "and summary. Use another run_dir, or wait for that job to end; if it is really gone, delete "
                    f"{self.path}."
                )
            self._take_over(raw, holder, reason)
        self._thread = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
        self._thread.start()
        log.info("run_dir lock %s taken (host %s, pid %d, run id %r)", self.path, self.host, os.getpid(), self.run_id)

    def _prepare_dir(self) -> None:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"run_dir {self.run_dir} is a file, not a directory. Point run_dir at a directory "
                              "(it is created when missing), or move the file away.")  # fmt: skip
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(
                f"Cannot create run_dir {self.run_dir}: {exc.strerror or exc}. Make its parent "
                "writable, or point run_dir at a writable volume; nothing was trained."
            ) from exc
        free = shutil.disk_usage(self.run_dir).free
        if free < MIN_FREE_BYTES:
            raise RunDirError(
                f"run_dir {self.run_dir} has only {free / 2**20:.2f} MiB free; checkpoints and the "
                "summary would not fit. Free space there or point run_dir at a larger volume."
            )

    def _create(self) -> bool:
        holder = {"host": self.host, "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                  "run_id": self.run_id, "started": self.clock(), "token": uuid.uuid4().hex}  # fmt: skip
        content = json.dumps(holder, sort_keys=True).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise RunDirError(f"run_dir {self.run_dir} is not writable: creating {self.path} failed with "
                              f"{exc.strerror or exc}. Make it writable for this user, or point run_dir at a "
                              "writable volume; nothing was trained.") from exc  # fmt: skip
        try:
            os.write(fd, content)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise RunDirError(
                f"run_dir {self.run_dir} is not writable: writing {self.path} failed with "
                f"{exc.strerror or exc}. Free space there or point run_dir elsewhere."
            ) from exc
        os.close(fd)
        self.content = content
        return True

    def _read(self) -> tuple[dict[str, Any], bytes, float]:
        """The holder, the raw bytes, and the seconds since its last renewal (0 when it just vanished)."""
        try:
            raw = self.path.read_bytes()
            age = self.clock() - self.path.stat().st_mtime
        except FileNotFoundError:
            return {}, b"", 0.0
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), raw, age

    def _stale_reason(self, holder: dict[str, Any], age: float) -> str | None:
        """Why the lock is abandoned, or None while its holder may still run."""
        pid = holder.get("pid")
        if holder.get("host") == self.host and isinstance(pid, int):
            return None if pid_alive(pid, holder.get("pid_start")) else f"its process {pid} on this host is gone"
        if age > self.stale_seconds:
            return f"it was last renewed {age:.0f} s ago (stale after {self.stale_seconds:.0f} s)"
        return None

    def _take_over(self, raw: bytes, holder: dict[str, Any], reason: str) -> None:
        """Move the stale lock aside, but only if it is still the one judged stale (another taker may have won)."""
        if not raw and not self.path.exists():
            return
        grave = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, grave)
        except FileNotFoundError:
            return
        try:
            if grave.read_bytes() != raw:  # someone else took it over and created a fresh lock: put it back
                with contextlib.suppress(FileExistsError):
                    os.link(grave, self.path)
                return
            log.warning("run_dir lock %s of %s is stale (%s): taking it over", self.path, describe_holder(holder),
                        reason)  # fmt: skip
        finally:
            grave.unlink(missing_ok=True)

    # ----------------------------------------------------------------------------- holding and giving it back

    def _ours(self) -> bool:
        try:
            return self.path.read_bytes() == self.content
        except OSError:
            return False

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.renew):
            if not self._ours():
                log.error("run_dir lock %s is no longer this job's (taken over after this process stalled for "
                          "%.0f s?); another job may now write to %s", self.path, self.stale_seconds,
                          self.run_dir)  # fmt: skip
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._ours():
            self.path.unlink(missing_ok=True)


def build_run_dir_guard(config: JobConfig, world: WorldInfo) -> RunDirGuard:
    """Rank 0 locks ``run_dir`` (and checks that it is writable and has room); the others hold nothing."""
    return RunDirLock(Path(config.run_dir), world.run_id) if world.rank == 0 else RunDirGuard()
