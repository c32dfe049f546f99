"""What one CUDA device says about this tree, in a few minutes: one table of check, result, figure, seconds.

No GPU has run this code before, so each row is a short, separate look, run in
a subprocess with its own time limit; one that fails or hangs cannot stop the
others, and rows that would start after ``--budget`` seconds say so. Rows:

* ``cuda device``: the device, torch, CUDA and NCCL versions;
* ``service imports``: the service's own dependencies (pydantic, ...) are installed;
* ``pytest: CUDA tests``: the tests that skip without CUDA (``-k cuda``), with their skip reasons;
* ``train amp=...``: one short job of the shapes task per AMP mode (off, bf16, fp16; fp16 says when this
  version's config has no such mode);
* ``example ...``: each bring-your-own example (``examples/*.yaml``) for a few steps on the device;
* ``async checkpoint``: a periodic save staged through pinned memory holds the same weights as a
  synchronous save of that step in a second run;
* ``snapshot copy``: ``bench/snapshot.py --parts breakdown`` on the device: the in-memory snapshot's
  device-to-host copy of the 101 MB MLP with AdamW (302 MB, into pinned buffers on a side stream) and its GB/s,
  one snapshot's cost through the real writer (its time on the training thread, its background CPU), and that
  what it wrote is the state of its step though the next step's forward, backward and update ran meanwhile;
* ``nccl world 1``, ``nccl 2 ranks / 1 GPU``: a plain NCCL all-reduce at world size 1, and at 2 processes on
  one device (NCCL normally refuses two ranks on one device: the row records what happens);
* ``service 2 ranks / 1 GPU``: what the service does when started with more processes than devices;
* ``bench/overhead.py`` (built-in and ``step_fn`` task), ``bench/checkpoint.py``: short runs, their headline figure;
* ``bench/boundary.py``: the bare loop, the task loop and a Session's loop on the device at world 1 (8 x
  Linear(4096, 4096), batch 512: a step of about 5-20 ms on a current GPU), the main thread's CPU per step over
  the bare loop's, and their wall time against the bare loop's (the whole itemized table is in its log);
  ``--only boundary`` runs it alone in about 2 minutes; with ``--without-cuda`` on a machine without CUDA it
  rehearses on the CPU at a CPU's size (2 x Linear(64, 64), batch 8).

Results: ``pass``, ``FAIL``, ``info`` (an outcome to record, neither), ``skip``. Exit 0 unless a row failed
(1); on a machine without CUDA every row is a quick ``skip`` and the exit is 0. Each row's full output is
kept under ``--log-dir`` (default ``runs/gpu-check``).

    python bench/gpu_check.py [--budget 280] [--log-dir runs/gpu-check] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this tree's service; tests/procs.py's kill_tree
QUICK = ("train.progress_bar=false", "metrics.tensorboard=false", "train.log_every=5")


@dataclasses.dataclass
class Row:
    check: str
    result: str = "skip"
    figure: str = ""
    seconds: float = 0.0


class Check:
    """What rows share: the log directory, the time left, and a subprocess runner with a limit."""

    def __init__(self, log_dir: Path, budget: float, rehearsal: bool = False) -> None:
        self.log_dir = log_dir
        self.deadline = time.monotonic() + budget
        self.rehearsal = rehearsal  # --without-cuda on a machine without CUDA: the benches at a CPU's size

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], timeout: float, **env: str) -> tuple[int | None, str]:
        """``(exit code, output)``; ``None`` when it ran past ``timeout`` (its whole process tree is killed)."""
        from procs import kill_tree

        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "examples")]),
                     "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1", **env}  # fmt: skip
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            child_env.pop(key, None)
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=max(1.0, min(timeout, self.left())))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            output, _ = proc.communicate()
            code = None
        log = self.log_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log"
        log.write_text(f"$ {' '.join(cmd)}\n{output}\n[exit {code}]\n")
        return code, output

    def train(self, name: str, nproc: int, *overrides: str, timeout: float = 60, config: str | None = None):
        """A real torchrun job of the service; ``(exit code, output, summary or None)``."""
        run_dir = self.log_dir / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "service", "train", *([config] if config else [])]  # fmt: skip
        for item in (*QUICK, f"run_dir={run_dir}", *overrides):
            cmd += ["--set", item]
        code, output = self.run(name, cmd, timeout)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        return code, output, summary


def last_line(output: str, pattern: str = r"(Error|error|refused|invalid|Duplicate)") -> str:
    """The line of ``output`` that says why: the last exception with a message (torchrun's own
    ChildFailedError aside), else the last line matching ``pattern``, else the last line; shortened."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    raised = [
        line for line in lines if re.search(r"\w(Error|Exception)\b: \S", line) and "ChildFailedError" not in line
    ]
    matching = [line for line in lines if re.search(pattern, line)]
    return (raised or matching or lines or ["(no output)"])[-1][:200]


def outcome(code: int | None, output: str, timeout: float) -> tuple[str, str] | None:
    """A FAIL row for a run that timed out or exited non-zero; ``None`` when it exited 0."""
    if code is None:
        return "FAIL", f"ran past its {timeout:.0f} s limit; {last_line(output, r'.')}"
    if code != 0:
        return "FAIL", f"exit {code}: {last_line(output)}"
    return None


# --- the rows -------------------------------------------------------------------------------------------------


def cuda_device(check: Check) -> tuple[str, str]:
    import torch

    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    return "pass", (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
                    f"{torch.cuda.device_count()} visible; torch {torch.__version__}, CUDA {torch.version.cuda}, "
                    f"NCCL {nccl}")  # fmt: skip


def service_imports(check: Check) -> tuple[str, str]:
    code, output = check.run("service imports", [sys.executable, "-c", "import service.cli, service.loop.train"], 60)
    if failed := outcome(code, output, 60):
        return failed[0], f"{failed[1]}; install them: pip install -e '.[test]' (or carry their wheels)"
    return "pass", "service.cli and service.loop.train import"


def parse_junit(path: Path) -> tuple[int, int, int, list[str]]:
    """``(passed, failed (failures + errors), skipped, skip reasons)`` of a pytest junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = skipped = 0
    reasons: list[str] = []
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            for skip in case.iter("skipped"):
                reasons.append(f"{case.get('name')}: {skip.get('message', '')}")
    return total - failed - skipped, failed, skipped, reasons


def pytest_cuda(check: Check) -> tuple[str, str]:
    junit = check.log_dir / "pytest-cuda.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "tests", "-k", "cuda", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={junit}"]  # fmt: skip
    code, output = check.run("pytest cuda", cmd, 150)
    if not junit.exists():
        return "FAIL", f"exit {code}, no junit report: {last_line(output)}"
    passed, failed, skipped, reasons = parse_junit(junit)
    figure = f"{passed} passed, {failed} failed, {skipped} skipped" + "".join(f"; skip {r}" for r in reasons)
    if code == 5 or passed + failed + skipped == 0:
        return "FAIL", "no test matched -k cuda"
    return ("FAIL" if failed or code not in (0, None) else "pass" if passed else "info"), figure


def amp_supported(check: Check, mode: str) -> str | None:
    """The config's error when this version's ``train.amp`` refuses ``mode``; ``None`` when it takes it."""
    cmd = [sys.executable, "-m", "service", "validate", "--set", f"train.amp={mode}"]
    code, output = check.run(f"validate amp={mode}", cmd, 60)
    if code == 0:
        return None
    refused = [line.strip() for line in output.splitlines() if "train.amp" in line]
    if not refused:  # exit 2 for some other reason: a broken install, not an answer about fp16
        raise RuntimeError(f"`service validate` exited {code}: {last_line(output)}")
    return refused[-1]


def train_amp(mode: str) -> Callable[[Check], tuple[str, str]]:
    def row(check: Check) -> tuple[str, str]:
        if mode != "off" and (refused := amp_supported(check, mode)):
            return "info", f"not supported by this version: {refused}"
        code, output, summary = check.train(f"amp-{mode}", 1, f"train.amp={mode}", "train.max_steps=30",
                                            "checkpoint.every_steps=0")  # fmt: skip
        if failed := outcome(code, output, 60) or (None if summary else ("FAIL", "exit 0 but no summary.json")):
            return failed
        if summary["device"] != "cuda":
            return "FAIL", f"trained on {summary['device']}, not cuda"
        loss = summary["final_loss"]
        ok = summary["status"] == "completed" and loss is not None and math.isfinite(loss)
        ok = ok and summary["nonfinite_steps"] == 0
        return ("pass" if ok else "FAIL"), (f"{summary['status']}, {summary['global_step']} steps, eval loss "
                                            f"{loss:.4f}, {summary['samples_per_second']:.0f} samples/s, "
                                            f"{summary['nonfinite_steps']} nonfinite")  # fmt: skip

    return row


def example(name: str) -> Callable[[Check], tuple[str, str]]:
    def row(check: Check) -> tuple[str, str]:
        code, output, summary = check.train(f"example-{name}", 1, "train.max_steps=20", "checkpoint.every_steps=0",
                                            config=f"examples/{name}.yaml")  # fmt: skip
        if failed := outcome(code, output, 60) or (None if summary else ("FAIL", "exit 0 but no summary.json")):
            return failed
        values = ", ".join(f"{key} {value:.4f}" for key, value in summary.get("eval_metrics", {}).items())
        ok = summary["status"] == "completed" and summary["device"] == "cuda"
        return ("pass" if ok else "FAIL"), (f"{summary['status']} on {summary['device']}, {summary['global_step']} "
                                            f"steps; eval {values}")  # fmt: skip

    return row


def async_checkpoint(check: Check) -> tuple[str, str]:
    """Step 15, staged through pinned buffers in the background, against a synchronous save of step 15."""
    import torch

    common = ("train.amp=off", "train.lr_schedule=constant", "train.epochs=10", "checkpoint.keep=5")
    code, output, summary = check.train("async", 1, *common, "train.max_steps=18", "checkpoint.every_steps=5",
                                        "checkpoint.async=true")  # fmt: skip
    if failed := outcome(code, output, 60):
        return failed
    code2, output2, _ = check.train("sync", 1, *common, "train.max_steps=15", "checkpoint.every_steps=0")
    if failed := outcome(code2, output2, 60):
        return failed[0], f"the synchronous run: {failed[1]}"
    staged = len(re.findall(r"staged in", output))
    name = "checkpoints/step-00000015.pt"
    runs = check.log_dir / "runs"
    async_model = torch.load(runs / "async" / name, weights_only=True)["model"]
    sync_model = torch.load(runs / "sync" / name, weights_only=True)["model"]
    diff = max((async_model[k].double() - sync_model[k].double()).abs().max().item() for k in sync_model)
    # Stale or half-copied staging would differ by steps of updates (about 1e-2); cuDNN's order of float
    # additions differs between runs by far less.
    ok = staged >= 3 and summary is not None and summary["checkpoint"]["failures"] == 0 and diff < 1e-4
    return ("pass" if ok else "FAIL"), f"{staged} saves staged; step 15 async vs sync: max abs dw {diff:.2e}"


NCCL_WORKER = """
import json, os, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
torch.cuda.set_device(device)
value = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(value)
big = torch.ones(16 * 2**20, device=device)
dist.all_reduce(big); torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(5):
    dist.all_reduce(big)
torch.cuda.synchronize()
ms = (time.perf_counter() - start) / 5 * 1e3
if rank == 0:
    print("NCCL_RESULT " + json.dumps({"sum": value.item(), "expected": world * (world + 1) / 2, "ms": ms}))
dist.destroy_process_group()
"""


def nccl(nproc: int) -> Callable[[Check], tuple[str, str]]:
    def row(check: Check) -> tuple[str, str]:
        script = check.log_dir / "nccl_worker.py"
        script.write_text(NCCL_WORKER)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
        code, output = check.run(f"nccl-{nproc}", cmd, 60)
        found = re.search(r"NCCL_RESULT (.*)", output)
        if code == 0 and found:
            result = json.loads(found.group(1))
            ok = result["sum"] == result["expected"]
            return ("pass" if ok else "FAIL"), (f"all-reduce sum {result['sum']:g} (expected {result['expected']:g}); "
                                                f"64 MiB all-reduce {result['ms']:.2f} ms")  # fmt: skip
        if nproc == 1:
            return outcome(code, output, 60) or ("FAIL", "no result line")
        how = "hung past 60 s" if code is None else f"exit {code}"
        return "info", f"NCCL refused or failed ({how}): {last_line(output)}"

    return row


def service_two_ranks(check: Check) -> tuple[str, str]:
    code, output, summary = check.train("service-2-ranks", 2, "train.max_steps=5", "checkpoint.every_steps=0")
    if code == 0 and summary is not None:
        return "info", f"trained: {summary['status']}, {summary['global_step']} steps, world {summary['world_size']}"
    how = "hung past 60 s" if code is None else f"exit {code}"
    return "info", f"refused ({how}): {last_line(output)}"


def bench(script: str, args: list[str], pattern: str, timeout: float,
          rehearsal: list[str] | None = None) -> Callable[[Check], tuple[str, str]]:  # fmt: skip
    """A bench's row: its headline line; ``rehearsal``: its arguments in a rehearsal on CPU (a size a CPU runs in
    the row's time: the device's would take minutes a step)."""

    def row(check: Check) -> tuple[str, str]:
        used = rehearsal if check.rehearsal and rehearsal is not None else args
        code, output = check.run(script, [sys.executable, script, *used], timeout)
        if failed := outcome(code, output, timeout):
            return failed
        found = re.search(pattern, output)
        return ("pass", found.group(0)) if found else ("FAIL", f"no line matching {pattern!r}")

    return row


OVERHEAD = r"throughput ratio service/bare[^:]*: [\d.]+"  # "... (builtin task): 0.987 (target >= 0.99)"
STALL = r"stall ratio async/sync: [\d.]+"
SNAPSHOT = r"snapshot on cuda: .* it holds the state of its step: yes"
SHORT = ["--rounds", "1", "--epochs", "2"]
BOUNDARY = r"boundary world 1 on \w+: .*"  # "... main-thread CPU per step over bare: task +412 µs (bare ...), ..."
BOUNDARY_ARGS = ["--worlds", "1", "--steps", "300", "--width", "4096", "--layers", "8", "--batch", "512"]
BOUNDARY_REHEARSAL = ["--worlds", "1", "--steps", "300", "--width", "64", "--layers", "2", "--batch", "8"]
ROWS: list[tuple[str, Callable[[Check], tuple[str, str]]]] = [
    ("cuda device", cuda_device),
    ("service imports", service_imports),
    ("pytest: CUDA tests", pytest_cuda),
    ("train amp=off", train_amp("off")),
    ("train amp=bf16", train_amp("bf16")),
    ("train amp=fp16", train_amp("fp16")),
    ("example mnist", example("mnist")),
    ("example nanogpt", example("nanogpt")),
    ("example word_lm", example("word_lm")),
    ("async checkpoint (pinned)", async_checkpoint),
    ("snapshot copy (pinned, side stream)", bench("bench/snapshot.py", ["--parts", "breakdown"], SNAPSHOT, 120)),
    ("nccl world 1", nccl(1)),
    ("nccl 2 ranks / 1 GPU", nccl(2)),
    ("service 2 ranks / 1 GPU", service_two_ranks),
    ("bench/overhead.py", bench("bench/overhead.py", SHORT, OVERHEAD, 90)),
    ("bench/overhead.py step_fn", bench("bench/overhead.py", [*SHORT, "--task", "step_fn"], OVERHEAD, 90)),
    ("bench/boundary.py", bench("bench/boundary.py", BOUNDARY_ARGS, BOUNDARY, 180, BOUNDARY_REHEARSAL)),
    ("bench/checkpoint.py", bench("bench/checkpoint.py", ["--rounds", "1", "--layers", "1"], STALL, 120)),
]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def table(rows: list[Row]) -> str:
    """One Markdown table: check, result, figure, seconds (a figure may be long; it wraps where it is read)."""
    width = max(len(row.check) for row in rows)
    lines = [
        f"| {'check':<{width}} | result | figure | seconds |",
        f"|{'-' * (width + 2)}|--------|--------|--------:|",
    ]
    for row in rows:
        figure = row.figure.replace("|", "/")
        lines.append(f"| {row.check:<{width}} | {row.result:<6} | {figure} | {row.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=280, help="seconds for all rows together (default 280)")
    parser.add_argument("--log-dir", type=Path, default=REPO / "runs" / "gpu-check", help="each row's full output")
    parser.add_argument("--only", nargs="*", help="run only the rows whose name contains one of these")
    parser.add_argument(
        "--without-cuda",
        action="store_true",
        help="run the rows even without CUDA (a rehearsal of the script: rows needing CUDA fail; bench/boundary.py "
        "runs at a CPU's size)",
    )
    args = parser.parse_args(argv)
    selected = [(name, fn) for name, fn in ROWS if not args.only or any(part in name for part in args.only)]
    if not selected:
        parser.error(f"--only {args.only} matches no row; the rows are: {', '.join(name for name, _ in ROWS)}")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    device = cuda_available()
    check, rows = Check(args.log_dir, args.budget, rehearsal=args.without_cuda and not device), []
    has_cuda = args.without_cuda or device
    for name, fn in selected:
        row = Row(name)
        if not has_cuda:
            row.figure = "no CUDA device (torch.cuda.is_available() is False)"
        elif check.left() <= 1:
            row.figure = f"not run: the --budget of {args.budget:.0f} s was spent"
        else:
            started = time.monotonic()
            try:
                row.result, row.figure = fn(check)
            except Exception as exc:  # one broken row must not stop the others
                row.result, row.figure = "FAIL", f"{type(exc).__name__}: {exc}"[:200]
            row.seconds = time.monotonic() - started
        rows.append(row)
        print(f"[gpu-check] {row.check}: {row.result} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    print(table(rows))
    print(f"logs: {args.log_dir}" + ("" if has_cuda else "; no CUDA device here, nothing was run"))
    return 1 if any(row.result == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
