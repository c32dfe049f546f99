"""Where a start's seconds go before its first step: marks on one clock, from the process's start.

The runtime and the loops mark each phase as it ends (the program's first line, the process group, the lock,
the config and resume agreements, the roles, the task, the wrapped model, the kept state, the first batch, the
first step); ``summary.json``'s ``startup`` holds them as seconds since the process started, and
``bench/startup.py`` compares them with the seed's bare recipe.
"""

from __future__ import annotations

import time


class StartupMarks:
    """Phase name → Unix time it ended; :meth:`as_dict` gives seconds since ``process_start``."""

    def __init__(self, process_start: float) -> None:
        self.process_start = process_start
        self.marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        """``name`` ended now (or at ``at``); the first mark of a name stands (a later one is the same phase
        again: a second feed, a restarted epoch)."""
        if name not in self.marks:  # the loop marks its first batch and step at every step: no clock read then
            self.marks[name] = time.time() if at is None else at

    def as_dict(self) -> dict[str, object]:
        """``{"process_start": Unix time, "phases": {name: seconds since then}}``, the phases in the order they
        ended."""
        ordered = sorted(self.marks.items(), key=lambda item: item[1])
        return {"process_start": round(self.process_start, 3),
                "phases": {name: round(at - self.process_start, 3) for name, at in ordered}}  # fmt: skip
