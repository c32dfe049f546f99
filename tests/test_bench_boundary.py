"""bench/boundary.py: its item table names functions that exist, and a short run prints every door and item.

The bench groups a cProfile of the service's loop by file and function name (``boundary.ITEMS``): a renamed
function would silently read 0 µs, so the names are checked here. Its figures are not tested (no timed test).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_env

_path = list(sys.path)
sys.path.append(str(REPO / "bench"))
import boundary  # noqa: E402

sys.path[:] = _path  # boundary puts bench/ first, and bench/rendezvous.py would shadow the tests' rendezvous package


def test_every_item_of_the_bench_names_a_function_that_exists():
    torch_root = Path(torch.__file__).parent
    for item, patterns in boundary.ITEMS.items():
        for file, function in patterns:
            path = (torch_root.parent / file if file.startswith("torch/") else REPO / file if file.startswith("bench/")
                    else REPO / "service" / file)  # fmt: skip
            assert path.is_file(), f"{item}: {path} is gone"
            if function != "*":
                assert re.search(rf"^\s*(def|class) {function}\b", path.read_text(), re.M), f"{item}: {function}"


@pytest.mark.e2e
def test_a_short_run_prints_each_door_against_bare_and_every_item(tmp_path):
    cmd = [sys.executable, "bench/boundary.py", "--steps", "30", "--worlds", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for door in ("bare", "task", "task -hook", "session"):
        assert re.search(rf"^{re.escape(door)}\s+\d", out, re.M), door
    assert "metrics.allreduce_timing (the comm hook, DDP's pre-forward timers, two histograms)" in out
    rows = {line[:52].strip(): line[52:].split() for line in out.splitlines() if line[:52].strip() in boundary.ITEMS}
    assert set(rows) == set(boundary.ITEMS)
    # Items every step runs, through both doors (task, scaled, session, scaled): the grouping found them.
    for item in ("seeding", "counting (state, plan)", "save_due (checkpoint, snapshot)", "comm hook (main thread part)",
                 "sinks: Prometheus", "data path (plan, collate, to device)"):  # fmt: skip
        task, _, session, _ = (float(cell) for cell in rows[item])
        assert task > 0 and session > 0, item
    assert float(rows["task step: non-finite guard, clip (bare clips too)"][0]) > 0
    assert re.search(r"^boundary world 2 on cpu: main-thread CPU per step over bare: task [+-]\d+ µs", out, re.M)
    for door in ("task", "task -hook", "session"):  # the writes (snapshot captures, checkpoints) timed apart
        assert re.search(
            rf"^\s+{re.escape(door)}: its writes \(rank 0: \d+ snapshot captures, \d+ checkpoints a run\) "
            r"[\d.-]+.* µs per step of main-thread CPU; over bare between its writes: [\d.-]+",
            out,
            re.M,
        ), door
