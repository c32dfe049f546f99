"""Files the service reads back from run_dir (or is handed), opened so that what is not a regular file does no harm.

A checkpoint, its manifest, the best pointer, a snapshot marker, the goodput ledger and the hang record are
all written by the service itself, as plain files. What stands at their names when they are read again may
be anything: a FIFO blocks a plain ``open()`` forever, ``/dev/zero`` never ends, a symbolic link leads out of
the directory. So each is opened only when it is a regular file, reached at most through a symlink that stays
inside its directory; with ``O_NONBLOCK`` (a FIFO swapped in after the check neither blocks the open nor a
read) and ``O_NOFOLLOW``, and checked again with ``fstat`` on the open descriptor. Anything else is a
``ValueError`` whose message names the file, what it is, and the fix; nothing was read from or written to it.
The readers bound what they read (their callers pass a limit, or read line by line with
:func:`bounded_lines`).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}  # fmt: skip


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words: "a FIFO (named pipe)", "a character device", ..."""
    return "a regular file" if stat.S_ISREG(mode) else KINDS.get(stat.S_IFMT(mode), "not a plain file")


def not_regular(name: str, mode: int, done: str = "read from") -> ValueError:
    return ValueError(f"{name} is {kind_of(mode)}, not a regular file; nothing was {done} it (delete it if you did "
                      "not put it there)")  # fmt: skip


def _target(directory: Path, name: str, done: str) -> Path:
    """``directory/name``, or where its symlink leads when that stays inside ``directory``; FileNotFoundError."""
    path = directory / name
    if stat.S_ISLNK(os.lstat(path).st_mode):
        target = path.resolve()
        if not target.is_relative_to(directory.resolve()):
            raise ValueError(f"{name} is a symbolic link to {target}, outside {directory}; nothing was {done} it "
                             "(delete the link if you did not put it there)")  # fmt: skip
        return target
    return path


def _open_checked(target: Path, name: str, flags: int, done: str, mode: int = 0o644) -> int:
    """``os.open`` with ``O_NONBLOCK | O_NOFOLLOW``, then ``fstat``: the descriptor of a regular file only."""
    try:
        fd = os.open(target, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link swapped in since the check
            raise not_regular(name, stat.S_IFLNK, done) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing without blocking
            raise not_regular(name, stat.S_IFIFO, done) from None
        raise
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        raise not_regular(name, opened.st_mode, done)
    return fd


def open_regular(directory: Path, name: str) -> tuple[BinaryIO, int]:
    """Open ``directory/name`` for reading and return it with its size, reading nothing; ``ValueError`` unless it
    is a regular file, reached at most through a symlink that stays inside ``directory``; ``FileNotFoundError``."""
    target = _target(directory, name, "read from")
    info = os.lstat(target)
    if not stat.S_ISREG(info.st_mode):  # checked before the open: a FIFO's open with O_NONBLOCK would succeed
        raise not_regular(name, info.st_mode)
    fd = _open_checked(target, name, os.O_RDONLY, "read from")
    file = os.fdopen(fd, "rb")
    return file, os.fstat(fd).st_size


def read_small(directory: Path, name: str, limit: int) -> bytes | None:
    """A small regular file's bytes (checked by :func:`open_regular`), or None when it is over ``limit``."""
    file, size = open_regular(directory, name)
    with file:
        raw = file.read(limit + 1) if size <= limit else b""
    return None if size > limit or len(raw) > limit else raw


def open_append(directory: Path, name: str) -> int:
    """An ``O_APPEND`` descriptor of ``directory/name``, created (0644) when absent; ``ValueError`` unless it is a
    regular file (a symlink at most inside ``directory``). Never blocks: a FIFO is refused, with or without a
    reader. One ``os.write`` of a whole line on it is one append, whole, even with other writers."""
    try:
        target = _target(directory, name, "written to")
    except FileNotFoundError:
        target = directory / name
    return _open_checked(target, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "written to")


def bounded_lines(file: BinaryIO, max_line: int) -> Iterator[bytes | None]:
    """The lines of ``file`` with their newline, one at a time, none held longer than ``max_line`` bytes: a longer
    line is read through in pieces and given as None. The last piece, when the file does not end in a newline,
    comes without one (a writer died in its write)."""
    while True:
        line = file.readline(max_line + 1)
        if not line:
            return
        if len(line) <= max_line:
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of an over-long line, a piece at a time
            line = file.readline(max_line + 1)
        yield None


def fsync_dir(directory: Path) -> None:
    """Make the names in ``directory`` durable (a rename into it, a file made in it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, write: Any) -> Any:
    """Create ``path``, let ``write(file)`` fill it, fsync it; returns what ``write`` returns."""
    with open(path, "wb") as file:
        result = write(file)
        file.flush()
        os.fsync(file.fileno())
    return result
