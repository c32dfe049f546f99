"""``run_dir/hangs.jsonl``: the hangs the watchdog found, kept across the restarts they cause.

A rank that finds a hang leaves with ``os._exit`` moments later, before any
scrape, so it appends one line here first (one ``write`` of a whole line on an
``O_APPEND`` file), and the Prometheus sink of the next start exports the
count and the last rank named (:func:`tally`). A line torn by a crash mid-write
(the last one, without its newline) is skipped; a line that is not such a
record is skipped with a warning. The file is read bounded: its last
:data:`MAX_BYTES` only; and only a regular file is read or written (a FIFO
planted at its name would block every start): anything else gets a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from service.state.files import open_append, open_regular

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 20  # about 5,000 hangs: a job that hung more has other problems
FILE = "hangs.jsonl"


@dataclasses.dataclass(frozen=True)
class HangTally:
    """The hangs one rank found so far in this run_dir, and the rank it named last (-1: none yet)."""

    count: int = 0
    behind_rank: int = -1


NO_HANGS = HangTally()


def append_hang(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line, in one ``write``: concurrent ranks' lines do not interleave. Anything but a
    regular file at ``path`` (a FIFO would block the open) gets nothing, and a warning; ``OSError``."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        fd = open_append(path.parent, path.name)
    except ValueError as exc:
        log.warning("the hang record %s is not written: %s", path, exc)
        return
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _valid(record: Any) -> bool:
    return (isinstance(record, dict) and type(record.get("rank")) is int
            and isinstance(record.get("behind"), list)
            and all(type(rank) is int for rank in record["behind"]))  # fmt: skip


def read_hangs(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` (none when it is missing), oldest first, torn or foreign lines skipped."""
    try:
        file, size = open_regular(path.parent, path.name)
    except FileNotFoundError:
        return []
    except ValueError as exc:  # a FIFO would block a plain open() forever
        log.warning("the hang record %s cannot be read: %s. The hang count starts from 0.", path, exc)
        return []
    with file:
        file.seek(max(0, size - MAX_BYTES))
        data = file.read(MAX_BYTES)
    lines = data.split(b"\n")
    if size > MAX_BYTES:
        lines = lines[1:]  # the first line read may be cut
    records = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        last = index == len(lines) - 1  # no newline after it: torn by a crash mid-write
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if last or not _valid(record):
            if not last:
                log.warning("%s: line %d is not a hang record; skipped", path, index + 1)
            continue
        records.append(record)
    return records


def tally(path: Path, rank: int) -> HangTally:
    """What rank ``rank`` found in ``path``: how many hangs, and the first rank its last one named."""
    own = [record for record in read_hangs(path) if record["rank"] == rank]
    if not own:
        return HangTally()
    behind = own[-1]["behind"]
    return HangTally(count=len(own), behind_rank=behind[0] if behind else -1)
