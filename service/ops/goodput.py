"""``ddp-service goodput RUN_DIR [--json]``: where the job's wall time went, from ``run_dir/goodput.jsonl``.

Works on a finished job and on a running one (its figures then run to rank 0's latest record, at most
``metrics.goodput_every_seconds`` old). Definitions: docs/monitoring.md, Goodput.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2


def add_parser(commands: Any) -> None:
    command = commands.add_parser("goodput", help="print where a job's wall time went, across its restarts")
    command.add_argument("run_dir", help="the job's run_dir (it holds goodput.jsonl)")
    command.add_argument("--json", dest="as_json", action="store_true", help="print the breakdown as JSON")


def table(breakdown: dict[str, Any]) -> str:
    wall = breakdown["wall_seconds"]
    rows = [("productive", breakdown["productive_seconds"]), *breakdown["badput_seconds"].items()]
    share = lambda seconds: f"{100 * seconds / wall:6.1f}%" if wall > 0 else "     -"  # noqa: E731
    lines = [f"{'category':<16}{'seconds':>12}{'share':>9}"]
    lines += [f"{name:<16}{seconds:>12.2f}{share(seconds):>9}" for name, seconds in rows]
    lines.append(f"{'wall':<16}{wall:>12.2f}{share(wall):>9}")
    lines.append(f"goodput {breakdown['ratio']:.3f} over {breakdown['starts']} start(s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from service.state.files import kind_of
    from service.telemetry.goodput import LEDGER, fold, read_starts

    path = Path(args.run_dir) / LEDGER
    if not path.is_file():
        what = f"is {kind_of(path.lstat().st_mode)}, not a ledger" if path.is_symlink() or path.exists() else (
            "does not exist")  # fmt: skip
        print(f"error: {path} {what}; pass the run_dir of a job that ran with metrics.goodput=true",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    records = read_starts(path)  # the last record of each start, streamed: all the fold needs
    if not records:
        print(f"error: {path} holds no valid goodput record; it is empty or not a ledger of ddp-service",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    breakdown = fold(records).as_dict()
    print(json.dumps(breakdown, indent=2) if args.as_json else table(breakdown))
    return 0
