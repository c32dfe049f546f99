"""A task module that needs at its import what torchrun gives each worker, as user code may: it reads ``RANK`` and
``LOCAL_WORLD_SIZE`` (a KeyError without them), starts a thread, and writes what it saw (pid, ``RANK``,
``LOCAL_WORLD_SIZE``, ``sys.argv``, cwd) to ``$IMPORT_PROBE_DIR/<pid>.json``. Its task is ``slow_tasks``'
``slow_shapes``, refused unless the import's thread is alive in the process that trains: the module must have
been imported there, not in a process it was forked from."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from slow_tasks import slow_shapes as _slow_shapes

from service.tasks.base import Task, TaskSpec

RANK = int(os.environ["RANK"])
LOCAL_WORLD_SIZE = int(os.environ["LOCAL_WORLD_SIZE"])
THREAD = threading.Thread(target=threading.Event().wait, name="import-probe", daemon=True)
THREAD.start()
if os.environ.get("IMPORT_PROBE_DIR"):
    seen = {"pid": os.getpid(), "rank": RANK, "local_world_size": LOCAL_WORLD_SIZE, "argv": sys.argv,
            "cwd": os.getcwd()}  # fmt: skip
    Path(os.environ["IMPORT_PROBE_DIR"], f"{os.getpid()}.json").write_text(json.dumps(seen))


def slow_shapes(spec: TaskSpec) -> Task:
    if not THREAD.is_alive():
        raise RuntimeError("import_probe_tasks' import-time thread is not alive in the process that trains")
    return _slow_shapes(spec)
