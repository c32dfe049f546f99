"""Where a node keeps its in-memory snapshots (:mod:`service.state.snapshot`): one directory per job and agent.

One directory per (run_dir, run id, host, agent process), under a root owned by
this user (``checkpoint.snapshot_dir``/ddp-service-<uid>, mode 0700), with a
marker ``job.json`` naming them. A restarted worker of the same agent finds its
node's area; another job's leftovers sit under another name, and an area whose
marker names another job is ignored (and replaced when this job writes): it is
never loaded.

``/dev/shm`` is writable by every local user, so another one can make the root
first. Such a root (another owner, not a directory, a link, a mode other than
0700) is never looked into, written to or removed from: the job starts with
snapshots off and one warning naming the root and its owner
(:meth:`Area.root_problem`). A root this user made cannot be taken: the sticky
``/dev/shm`` lets nobody else remove or rename it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pwd
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.state.files import read_small

log = logging.getLogger("service.state.snapshot")

MARKER = "job.json"


@dataclass(frozen=True)
class Area:
    """One node's snapshot directory for one job, and the marker that says whose it is."""

    path: Path
    owner: dict[str, Any]

    def root_problem(self) -> str | None:
        """Why the root of this user's areas cannot be used (None: it is this user's directory, mode 0700, or it
        does not exist yet). ``/dev/shm`` is writable by every local user: another one may have made it first."""
        return foreign(self.path.parent)

    def problem(self) -> str | None:
        """Why this area must not be read (None: it is this job's, or it does not exist yet)."""
        for directory in (self.path.parent, self.path):
            try:
                info = os.lstat(directory)
            except FileNotFoundError:
                return None
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                return (f"{directory} is not a directory of this user with mode 0700; nothing in it is read "
                        "(remove it if you did not make it)")  # fmt: skip
        try:
            raw = read_small(self.path, MARKER, 4096)
            marker = json.loads(raw) if raw is not None else None
        except FileNotFoundError:
            return f"{self.path} has no {MARKER}; it is not a snapshot area of this job"
        except ValueError as exc:
            return f"its {MARKER} is not readable ({exc})"
        if marker != self.owner:
            return f"its {MARKER} names another job ({marker!r}); this job is {self.owner!r}"
        return None

    def readable(self) -> Path | None:
        """The directory to resume from, when it exists and is this job's; a warning when it is not."""
        if self.root_problem() is not None:
            return None  # another user's (or not a directory): never looked into; the writer's preflight says so
        try:
            os.lstat(self.path)
        except FileNotFoundError:
            return None
        why = self.problem()
        if why is not None:
            log.warning("ignoring the snapshots in %s: %s", self.path, why)
            return None
        return self.path

    def prepare(self) -> None:
        """Make the root and the area (mode 0700) and write the marker; an area of another job is emptied first."""
        for _ in range(2):  # before making it, and after: another user may make it in between
            why = self.root_problem()  # made by another user before this job: never looked into
            if why is not None:
                raise OSError(why)
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.exists() and self.problem() is not None:
            shutil.rmtree(self.path)
        self.path.mkdir(mode=0o700, exist_ok=True)
        marker = self.path / MARKER
        if not marker.exists():
            temporary = self.path / f".{MARKER}.{os.getpid()}.tmp"
            temporary.write_text(json.dumps(self.owner))
            os.replace(temporary, marker)
        why = self.problem()
        if why is not None:
            raise OSError(why)

    def remove(self) -> None:
        if self.root_problem() is None:  # nothing is removed under another user's root
            shutil.rmtree(self.path, ignore_errors=True)


def owner_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def foreign(root: Path) -> str | None:
    """Why ``root`` is not this user's own directory of mode 0700 (None: it is, or it does not exist yet)."""
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{root} cannot be examined ({exc.strerror or exc})"
    owner = owner_name(info.st_uid)
    elsewhere = ("; nothing under it is used. Remove it (its owner or root can), or point checkpoint.snapshot_dir "
                 "at a directory no other user can write, such as $XDG_RUNTIME_DIR")  # fmt: skip
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a file"
        return f"{root} is {kind}, not a directory, owned by {owner}{elsewhere}"
    if info.st_uid != os.getuid():
        return f"{root} is owned by {owner}, not by this user ({owner_name(os.getuid())}){elsewhere}"
    if info.st_mode & 0o077:
        return (f"{root} has mode {stat.S_IMODE(info.st_mode):04o}, not 0700: other users may write into it; "
                f"nothing under it is used. `chmod 700 {root}` if you made it")  # fmt: skip
    return None


def node_area(root: str, run_dir: str, run_id: str | None, host: str | None = None,
              agent: int | None = None) -> Area | None:  # fmt: skip
    """This node's area for this job, or None without a run id (nothing restarts such a process in place).

    ``agent``: the process that restarts this worker (its parent: torchrun's agent, or slurmstepd).
    """
    if not run_id:
        return None
    owner = {
        "run_dir": str(Path(run_dir).resolve()),
        "run_id": run_id,
        "host": host or socket.gethostname(),
        "agent": os.getppid() if agent is None else agent,
    }
    key = hashlib.sha256(json.dumps(owner, sort_keys=True).encode()).hexdigest()[:24]
    return Area(areas_root(root) / key, owner)


def areas_root(root: str | Path) -> Path:
    """Where this user's snapshot areas lie under ``checkpoint.snapshot_dir``."""
    return Path(root) / f"ddp-service-{os.getuid()}"


def list_areas(root: str | Path) -> list[Path]:
    """The directories of this user's snapshot areas under ``root`` (symlinks left out), sorted.

    Raises ``OSError`` when they cannot be listed (``FileNotFoundError`` when there is none yet).
    """
    return sorted(path for path in areas_root(root).iterdir() if path.is_dir() and not path.is_symlink())


def read_owner(area: Path) -> dict[str, Any]:
    """What the marker of ``area`` says: its job (run_dir, run id) and the agent process and host that own it.

    Raises ``FileNotFoundError`` without a marker, ``ValueError`` (whose text says why) for a marker that cannot
    be read or names no agent process and host.
    """
    try:
        raw = read_small(area, MARKER, 4096)
        owner = json.loads(raw) if raw is not None else None
    except ValueError as exc:
        raise ValueError(f"its {MARKER} cannot be read ({exc})") from exc
    if not isinstance(owner, dict) or type(owner.get("agent")) is not int or not isinstance(owner.get("host"), str):
        raise ValueError(f"its {MARKER} names no agent process")
    return owner


def areas_of_agent(root: str, agent: int, host: str | None = None) -> list[Area]:
    """The areas under ``root`` whose marker names ``agent`` on this host: what that agent's workers wrote.

    Only directories of this user with mode 0700 (see :meth:`Area.problem`) and a readable marker count.
    """
    host = host or socket.gethostname()
    found = []
    try:
        paths = list_areas(root)
    except OSError:
        return []
    for path in paths:
        try:
            owner = read_owner(path)
        except (OSError, ValueError):
            continue
        if owner["agent"] == agent and owner["host"] == host:
            area = Area(path, owner)
            if area.problem() is None:
                found.append(area)
    return found
