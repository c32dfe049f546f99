"""One job per ``run_dir``: rank 0 holds ``run_dir/.lock`` for the job's life.

The lock file appears whole or not at all: it is written under a scratch
name and hard-linked to ``.lock``, which fails when a lock is there (atomic on
local file systems, on NFSv3 and later, and on Lustre; where hard links are
not supported, ``O_CREAT | O_EXCL`` creates it instead). It holds who took it
(host, pid, the pid's start time, the launcher's run id, when, a unique token).
A thread checks it every :data:`CHECK_SECONDS` and renews its mtime every
:data:`RENEW_SECONDS` while the job runs. See docs/resume.md, "One job per
run_dir", for why not ``flock``.

A lock whose holder is gone is taken over with a warning: on the same host
when the pid is not alive (or is, but started at another time: a reused pid),
on another host when the mtime is older than :data:`STALE_AFTER` renewals.
Any number of takers of one stale lock make one winner
(:meth:`RunDirLock._take_over`). A fresh lock of *another* job is refused with
:class:`RunDirLockedError` naming the holder. A fresh lock of the *same* run id
on another host (the previous rendezvous round's rank 0 on a node that was
lost) is waited for until it goes stale. A restart of the same job on the same
host finds the previous rank 0 dead and takes over at once; a clean exit
removes the lock. A holder that finds its lock gone or another's calls its
:meth:`~RunDirGuard.on_lost` callbacks: the job stops at its next step
boundary and writes nothing more into ``run_dir``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from service.config import JobConfig
from service.world.env import WorldInfo
from service.world.holder import describe_holder, parse_holder, pid_alive, process_start

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
TAKEOVER_PREFIX = f"{LOCK_NAME}.takeover-"  # + the digest of the stale lock it replaces
SCRATCH_PREFIX = f"{LOCK_NAME}.new-"  # + pid and a random suffix: a lock being written
RENEW_SECONDS = 5.0
CHECK_SECONDS = 0.5  # how often the holder reads its lock back (a loss stops the job within about this)
STALE_AFTER = 6  # renewals missed before a lock on another host counts as abandoned
MIN_FREE_BYTES = 1 << 20  # below this, not even the lock, the summary and a small checkpoint fit
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


class RunDirError(RuntimeError):
    """``run_dir`` cannot hold this job's outputs (a file, read-only, full); the message names the fix."""


class RunDirLockedError(RunDirError):
    """Another live job holds ``run_dir``; the message names it."""


class RunDirGuard:
    """Holds nothing: every rank but 0."""

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        yield

    def on_lost(self, *callbacks: Callable[[str], None]) -> contextlib.AbstractContextManager[None]:
        """Within the ``with``, call these with the reason once the lock is gone or another's (from the watcher
        thread; at once if it already is). Nothing of theirs is kept after it: the job must die with its frame."""
        return contextlib.nullcontext()

    def vacant(self) -> bool:
        """Whether no job holds ``run_dir`` now (nothing at the lock's path)."""
        return True


class RunDirLock(RunDirGuard):
    def __init__(self, run_dir: Path, run_id: str | None, renew: float = RENEW_SECONDS, stale_after: int = STALE_AFTER,
                 clock: Callable[[], float] = time.time, check: float = CHECK_SECONDS) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self.run_id = run_id
        self.renew = renew
        self.check = min(check, renew)
        self.stale_seconds = renew * stale_after
        self.clock = clock
        self.host = socket.gethostname()
        self.content = b""
        self.lost: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._callbacks_lock = threading.Lock()
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
        holder = {"host": self.host, "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                  "run_id": self.run_id, "started": self.clock(), "token": uuid.uuid4().hex}  # fmt: skip
        self.content = json.dumps(holder, sort_keys=True).encode()
        deadline = None
        while not self._place(self.content, self.path):
            found = self._read()
            if found is None:
                continue  # released between our create and our read
            holder, raw, age = found
            if not holder and age < 2.0:
                time.sleep(0.1)  # its creator is between O_EXCL and the write (no hard links there)
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
                    "and summary. Use another run_dir, or wait for that job to end (a SIGTERM to it saves a "
                    f"checkpoint and stops it). Do not delete {self.path}: the lock of a job that is gone is taken "
                    "over by the next start on its own (on the same host once its process has exited, from another "
                    f"host once it is {self.stale_seconds:.0f} s without renewal), and deleting the lock of a live "
                    "job lets two jobs run until that job sees it and stops."
                )
            if self._take_over(raw):
                log.warning("run_dir lock %s of %s is stale (%s): taking it over", self.path, describe_holder(holder),
                            reason)  # fmt: skip
                break
        self._sweep()
        self._thread = threading.Thread(target=self._watch, name="run-dir-lock", daemon=True)
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

    def _scratch(self, content: bytes) -> Path:
        """``content`` written and flushed under a name of its own, ready to be linked or renamed into place."""
        path = self.run_dir / f"{SCRATCH_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise RunDirError(f"run_dir {self.run_dir} is not writable: creating {path} failed with "
                              f"{exc.strerror or exc}. Make it writable for this user, or point run_dir at a "
                              "writable volume; nothing was trained.") from exc  # fmt: skip
        try:
            os.write(fd, content)
            os.fsync(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise RunDirError(
                f"run_dir {self.run_dir} is not writable: writing {path} failed with "
                f"{exc.strerror or exc}. Free space there or point run_dir elsewhere."
            ) from exc
        finally:
            os.close(fd)
        return path

    def _place(self, content: bytes, target: Path) -> bool:
        """Make ``target`` hold ``content`` if nothing is there; False if something is (or our scratch was swept)."""
        scratch = self._scratch(content)
        try:
            os.link(scratch, target)
        except FileExistsError:
            with contextlib.suppress(OSError):
                return os.stat(scratch).st_nlink == 2  # NFS: a retried link that had worked reports EEXIST
            return False
        except FileNotFoundError:
            return False  # swept as a leftover while this process stalled; the caller looks again
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise RunDirError(f"run_dir {self.run_dir} is not writable: linking {target} failed with "
                                  f"{exc.strerror or exc}. Point run_dir at a writable volume.") from exc  # fmt: skip
            return self._create_exclusive(content, target)
        finally:
            scratch.unlink(missing_ok=True)
        return True

    def _create_exclusive(self, content: bytes, target: Path) -> bool:
        """``_place`` on a file system without hard links: an ``O_EXCL`` create, then the write."""
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, content)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _raw(self, path: Path | None = None) -> bytes | None:
        """The bytes at ``path`` (the lock), None when nothing is there; never follows a link."""
        try:
            fd = os.open(path or self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:
            return b""  # a link, a directory: nobody's lock (``_read`` says what it is)
        try:
            return os.read(fd, 1 << 16)
        except OSError:
            return b""
        finally:
            os.close(fd)

    def _read(self) -> tuple[dict[str, Any], bytes, float] | None:
        """The holder, the raw bytes, and the seconds since its last renewal; None when there is no lock."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            raise RunDirError(self._not_a_lock(info))
        raw = self._raw()
        if raw is None:
            return None
        return parse_holder(raw), raw, self.clock() - info.st_mtime

    def _not_a_lock(self, info: os.stat_result) -> str:
        if stat.S_ISLNK(info.st_mode):
            target = os.readlink(self.path)
            dangling = "" if self.path.exists() else ", which does not exist"
            what, remove = f"a symbolic link to {target!r}{dangling}", f"rm {self.path}"
        elif stat.S_ISDIR(info.st_mode):
            what, remove = "a directory", f"rmdir {self.path} (or rm -r, after a look at what it holds)"
        else:
            what, remove = "a special file (not a regular one)", f"rm {self.path}"
        return (f"run_dir lock {self.path} is {what}, not a lock file: this service writes the lock as a plain "
                f"file, itself. If no job uses run_dir {self.run_dir}, remove it ({remove}) and start again; to "
                "keep outputs elsewhere, point run_dir there instead of linking files into it; nothing was "
                "trained.")  # fmt: skip

    def _stale_reason(self, holder: dict[str, Any], age: float) -> str | None:
        """Why the lock is abandoned, or None while its holder may still run."""
        pid = holder.get("pid")
        if holder.get("host") == self.host and isinstance(pid, int):
            return None if pid_alive(pid, holder.get("pid_start")) else f"its process {pid} on this host is gone"
        if age > self.stale_seconds:
            return f"it was last renewed {age:.0f} s ago (stale after {self.stale_seconds:.0f} s)"
        return None

    def _take_over(self, stale: bytes) -> bool:
        """Replace the lock ``stale`` with ours; True when we did. Of any number of takers, one wins.

        The right to replace one lock is a marker named by its digest, placed the
        way the lock is (whole, and only if absent), so only one taker places it;
        it holds that taker's lock. The winner renames its lock over the stale
        one: the lock is never absent, so no create slips in between. A taker
        that finds the marker finishes the swap itself when it is still due (its
        winner may have died mid-way; its lock is then stale in turn), and looks
        again. Markers stay after their swap, so a taker that read ``stale``
        long ago cannot place a second one; they are swept once old.
        """
        marker = self.run_dir / f"{TAKEOVER_PREFIX}{hashlib.sha256(stale).hexdigest()[:32]}"
        if self._place(self.content, marker):
            if self._raw() == stale:
                os.replace(self._scratch(self.content), self.path)
            return self._raw() == self.content
        successor = self._raw(marker)
        if successor and self._raw() == stale:
            os.replace(self._scratch(successor), self.path)
        elif successor == b"" and self._age(marker) > self.stale_seconds:
            marker.unlink(missing_ok=True)  # its taker died between O_EXCL and the write (no hard links here)
        return False

    def _age(self, path: Path) -> float:
        try:
            return self.clock() - os.lstat(path).st_mtime
        except FileNotFoundError:
            return 0.0

    def _sweep(self) -> None:
        """Remove takeover markers and scratch files older than a stale lock: leftovers of swaps long done."""
        for leftover in (*self.run_dir.glob(f"{TAKEOVER_PREFIX}*"), *self.run_dir.glob(f"{SCRATCH_PREFIX}*")):
            if self._age(leftover) > self.stale_seconds:
                leftover.unlink(missing_ok=True)

    # ----------------------------------------------------------------------------- holding and giving it back

    @contextlib.contextmanager
    def on_lost(self, *callbacks: Callable[[str], None]) -> Iterator[None]:
        with self._callbacks_lock:
            self._callbacks.extend(callbacks)
            lost = self.lost
        for callback in callbacks if lost is not None else ():
            callback(lost)  # type: ignore[arg-type]
        try:
            yield
        finally:
            with self._callbacks_lock:
                self._callbacks = [known for known in self._callbacks if known not in callbacks]

    def _watch(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(self.check):
            raw = self._raw()
            if raw != self.content:
                self._lose(raw)
                return
            if time.monotonic() - renewed >= self.renew:
                with contextlib.suppress(OSError):
                    os.utime(self.path)
                renewed = time.monotonic()

    def _lose(self, raw: bytes | None) -> None:
        if raw is None:
            what = "was deleted"
        elif holder := parse_holder(raw):
            what = f"was taken by {describe_holder(holder)}"
        else:
            what = "was replaced by something that is not this job's lock"
        message = (
            f"The run_dir lock {self.path} {what} while this job held it, so another job may now write to "
            f"{self.run_dir}. This job stops at its next step boundary and saves no further checkpoint there. "
            "Keep one job per run_dir and never delete the lock of a running job; run this job again when "
            "the other has ended (it resumes from its newest checkpoint), or give it another run_dir."
        )
        with self._callbacks_lock:
            self.lost = message
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(message)
        log.error("%s", message)  # after the callbacks: once it is said, the writers are fenced

    def vacant(self) -> bool:
        return not os.path.lexists(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._raw() == self.content:
            self._sweep()
            self.path.unlink(missing_ok=True)


def build_run_dir_guard(config: JobConfig, world: WorldInfo) -> RunDirGuard:
    """Rank 0 locks ``run_dir`` (and checks that it is writable and has room); the others hold nothing."""
    return RunDirLock(Path(config.run_dir), world.run_id) if world.rank == 0 else RunDirGuard()
