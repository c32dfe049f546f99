"""``run_dir/goodput.jsonl``: the goodput ledger's records, read a line at a time, and its compaction.

Rank 0 appends one line (a :class:`Record`: its start's totals so far) at start, every
``metrics.goodput_every_seconds`` and at the end, for the life of the job: a 35-day job writes 300,000 lines.
The fold (:mod:`service.telemetry.goodput`) needs only the last record of each start, so the ledger is read
as a stream (:func:`read_starts`): a line at a time, none held over :data:`MAX_LINE` bytes, keeping only the
newest valid record of each start. Memory grows with the number of starts, not of lines. At each start rank
0 compacts the ledger (:func:`compact`): it is rewritten atomically as those records, so the next start reads
a few lines, not the job's whole history; a compaction killed midway leaves a temporary file, removed at the next
start. The file is opened only when it is a regular file
(:mod:`service.state.files`): a FIFO planted at its name is refused with a warning, never waited on.

A record is a line with its newline. The writer writes both in one ``os.write`` on an ``O_APPEND`` descriptor,
so a last line without one is a write that did not finish, and it is skipped even when its bytes hold a whole,
valid record (decided in issue 39): a reader that took it would count a record that is later cut off. What
is lost is a dying start's last record, whose time since its previous record the fold then counts as a gap.
Before its first append, rank 0 cuts such a torn last line off (:func:`cut_torn_tail`), so the next start's
first record begins a line of its own and is never glued to the torn one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.state.files import bounded_lines, open_regular

log = logging.getLogger(__name__)

LEDGER = "goodput.jsonl"
SLACK = 0.05  # seconds of clock jitter a record's own sums may exceed its span by
MAX_LINE = 64 * 1024  # a record is about 600 bytes; a longer line is skipped, never held
MAX_STARTS = 100_000  # a job restarts a few hundred times; past this a ledger is not one job's
Status = Literal["running", "completed", "preempted", "failed", "lock_lost"]


class Record(BaseModel):
    """One line of the ledger: one start's totals at ``time`` (Unix seconds); times are Unix, durations seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["start", "progress", "end"]
    pid: int = Field(ge=1)
    time: float = Field(gt=0)
    process_start: float = Field(gt=0)
    restart_count: int = Field(ge=0)
    world_size: int = Field(ge=1)
    rendezvous_round: int | None = Field(None, ge=0)
    group_began: float | None = None  # the process group set-up: entered ...
    group_up: float | None = None  # ... and returned (its wait is the worker's share of the rendezvous)
    restore_seconds: float = Field(0.0, ge=0)  # the resume: the agreement and the load of the checkpoint
    resumed_step: int | None = Field(None, ge=0)
    first_step: float | None = None  # when this start's first optimizer step began
    step: int = Field(0, ge=0)  # the job's global step at ``time``
    steps: int = Field(0, ge=0)  # optimizer steps this start took
    productive: float = Field(0.0, ge=0)  # step time less data wait
    data_wait: float = Field(0.0, ge=0)
    checkpoint: float = Field(0.0, ge=0)  # the training thread's stall, not a background write
    eval: float = Field(0.0, ge=0)
    status: Status = "running"

    @model_validator(mode="after")
    def _consistent(self) -> Record:
        marks = [self.process_start, self.group_began, self.group_up, self.first_step, self.time]
        known = [mark for mark in marks if mark is not None]
        if any(later < earlier - SLACK for earlier, later in zip(known, known[1:], strict=False)):
            raise ValueError("process_start <= group_began <= group_up <= first_step <= time does not hold")
        spent = self.productive + self.data_wait + self.checkpoint + self.eval + self.restore_seconds
        if spent > (self.time - self.process_start) * 1.01 + SLACK:
            raise ValueError(f"{spent:.3f} s accounted in a start of {self.time - self.process_start:.3f} s")
        if (self.first_step is None) != (self.steps == 0):
            raise ValueError("first_step is set exactly when steps > 0")
        return self

    @property
    def start_id(self) -> tuple[int, float]:
        return self.pid, self.process_start


def last_per_start(records: Iterable[Record], most: int | None = None) -> list[Record]:
    """The latest record of each start (by time), the starts in the order they began; with ``most``, records of
    starts past the first ``most`` are left out (with a warning)."""
    latest: dict[tuple[int, float], Record] = {}
    for record in records:
        known = latest.get(record.start_id)
        if known is None and most is not None and len(latest) >= most:
            log.warning("the goodput ledger holds more than %d starts; the rest are left out of its figures (move "
                        "the file aside if it is not this job's)", most)  # fmt: skip
            break
        if known is None or record.time >= known.time:
            latest[record.start_id] = record
    return sorted(latest.values(), key=lambda record: (record.process_start, record.pid))


def iter_ledger(path: Path) -> Iterator[Record]:
    """Each valid record of the ledger at ``path`` (none if there is none), in file order, a line at a time.

    A torn last line (no newline: a writer died in its write), a line over :data:`MAX_LINE` bytes, and a line
    that is not JSON or not a valid :class:`Record` are skipped and counted in one warning. Anything but a
    regular file at ``path`` gives no record and a warning that names it.
    """
    try:
        file, _ = open_regular(path.parent, path.name)
    except FileNotFoundError:
        return
    except (ValueError, OSError) as exc:
        log.warning("the goodput ledger %s cannot be read: %s. Its figures leave the job's earlier starts out.",
                    path, exc)  # fmt: skip
        return
    skipped = 0
    with file:
        for line in bounded_lines(file, MAX_LINE):
            record = None
            if line is not None and line.endswith(b"\n"):
                if not line.strip():
                    continue
                try:
                    record = Record.model_validate_json(line)
                except ValidationError:  # not JSON (or not UTF-8), or not a valid record
                    pass
            elif line is not None and not line.strip():
                continue
            if record is None:
                skipped += 1
                continue
            yield record
    if skipped:
        log.warning("%s: skipped %d line(s) that are torn, not JSON or not a valid goodput record", path, skipped)


def read_ledger(path: Path) -> list[Record]:
    """Every valid record of the ledger at ``path``, in file order: all of them in memory, for a look at a whole
    ledger; the service reads :func:`read_starts`."""
    return list(iter_ledger(path))


def read_starts(path: Path, most: int = MAX_STARTS) -> list[Record]:
    """The last valid record of each start in the ledger at ``path``, streamed: what the fold needs, in memory
    that grows with the starts (at most ``most``, :data:`MAX_STARTS`; a test lowers it), not with the lines."""
    return last_per_start(iter_ledger(path), most)


def cut_torn_tail(path: Path, fd: int) -> int:
    """Cut the ledger at ``path`` back to the end of its last whole line, through ``fd`` (rank 0's append
    descriptor), so the next append begins a line; returns the bytes cut. The bytes cut are a line that no reader
    takes (:func:`iter_ledger` skips a last line without its newline), so no reader's view changes."""
    file, size = open_regular(path.parent, path.name)
    with file:
        end = size
        while end > 0:  # back a chunk at a time to the last newline: a torn line may be long
            start = max(0, end - MAX_LINE)
            file.seek(start)
            found = file.read(end - start).rfind(b"\n")
            if found >= 0:
                end = start + found + 1
                break
            end = start
    if end < size:
        os.ftruncate(fd, end)
        log.warning("the goodput ledger %s ended in a torn line (%d bytes, a writer that died in its write): cut "
                    "off, so this start's records begin a line of their own", path, size - end)  # fmt: skip
    return size - end


def compact(path: Path, starts: list[Record], most: int = MAX_STARTS) -> None:
    """Rewrite the ledger at ``path`` as ``starts`` (what :func:`read_starts` gave with the same ``most``), when it
    holds more.

    Atomic: written to a temporary name, fsynced, renamed over the ledger; a failure leaves the ledger as it
    was (with a warning). Only rank 0 writes the ledger, and this runs before its start appends anything. A
    ledger that is not a regular file, or of which nothing or not every start was read, is left alone: a read
    that reached ``most`` starts may have stopped there, so a ledger of exactly ``most`` starts is left as it is.
    The temporary files of a compaction killed before its rename (rank 0 SIGKILLed) go first, whatever comes next.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # only rank 0, holding run_dir's lock, compacts
        if stale.name[len(path.name) + 2 : -4].isdigit():
            with contextlib.suppress(OSError):
                stale.unlink()
    if not starts or len(starts) >= most:  # nothing read (an unreadable file), or maybe not all of it
        return
    data = b"".join(record.model_dump_json().encode() + b"\n" for record in starts)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode) or info.st_size <= len(data):
        return
    try:
        with open(tmp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("the goodput ledger %s could not be compacted (%s); it stays as it was", path,
                    exc.strerror or exc)  # fmt: skip
        return
    finally:
        tmp.unlink(missing_ok=True)
    log.info("compacted the goodput ledger %s from %d to %d bytes: the last record of each of its %d start(s)",
             path, info.st_size, len(data), len(starts))  # fmt: skip
