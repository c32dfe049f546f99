"""Who holds a run dir's lock: whether that process still runs (its pid and start time), and how a
refusal names it.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc``), or None where it cannot be read."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[1].split()[19]


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


def parse_holder(raw: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}
