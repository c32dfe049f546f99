"""bench/gpu_check.py on a machine without a GPU: every row skips at once, and its row machinery holds.

The rows themselves need CUDA; what can be checked here is that the script
runs, prints one table, and that one failing, raising or hanging row (a whole
process tree) cannot stop the others or the time budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, child_env

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


@pytest.mark.e2e
def test_gpu_check_without_a_device_prints_one_table_of_skips_fast(tmp_path):
    started = time.monotonic()
    cmd = [sys.executable, "bench/gpu_check.py", "--log-dir", str(tmp_path)]
    env = child_env(CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - started < 30
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("| check") for line in lines) == 1  # one table
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| check")]
    assert [row.split("|")[1].strip() for row in rows] == [name for name, _ in gpu_check.ROWS]
    for row in rows:
        check, result, figure, seconds = (cell.strip() for cell in row.strip("|").split("|"))
        assert (result, seconds) == ("skip", "0.0") and "no CUDA device" in figure, row
    assert "no CUDA device here, nothing was run" in proc.stdout


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read()  # a zombie is gone but for its exit status
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.e2e
def test_gpu_check_a_raising_or_hanging_row_fails_alone_and_its_process_tree_is_killed(tmp_path, monkeypatch, capsys):
    pid_file = tmp_path / "grandchild.pid"
    hang = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")  # fmt: skip

    def raising(check: gpu_check.Check) -> tuple[str, str]:
        raise KeyError("final_loss")

    def hanging(check: gpu_check.Check) -> tuple[str, str]:
        code, output = check.run("hang", [sys.executable, "-c", hang], timeout=2)
        return gpu_check.outcome(code, output, 2) or ("pass", "it returned")

    rows = [("raises", raising), ("hangs", hanging), ("fine", lambda check: ("pass", "42 samples/s"))]
    monkeypatch.setattr(gpu_check, "ROWS", rows)
    started = time.monotonic()
    code = gpu_check.main(["--without-cuda", "--log-dir", str(tmp_path)])
    assert time.monotonic() - started < 20
    out = capsys.readouterr().out
    assert code == 1
    assert "| raises | FAIL   | KeyError: 'final_loss' |" in out
    assert "| hangs  | FAIL   | ran past its 2 s limit" in out
    assert "| fine   | pass   | 42 samples/s |" in out
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the hanging row's grandchild outlived its limit"
    assert (tmp_path / "hang.log").read_text().endswith("[exit None]\n")


@pytest.mark.e2e
def test_gpu_check_rows_after_the_budget_say_so(tmp_path, monkeypatch, capsys):
    def slow(check: gpu_check.Check) -> tuple[str, str]:
        code, output = check.run("slow", [sys.executable, "-c", "import time; time.sleep(60)"], timeout=60)
        return gpu_check.outcome(code, output, 60) or ("pass", "")

    monkeypatch.setattr(gpu_check, "ROWS", [("slow", slow), ("next", lambda check: ("pass", "ran"))])
    assert gpu_check.main(["--without-cuda", "--budget", "2", "--log-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "| slow | FAIL   | ran past its 60 s limit" in out  # cut at the budget, long before 60 s
    assert "| next | skip   | not run: the --budget of 2 s was spent | 0.0 |" in out


def test_gpu_check_only_names_no_row(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--only", "nonesuch"])
    assert exc.value.code == 2 and "matches no row; the rows are: cuda device" in capsys.readouterr().err


def test_gpu_check_reads_pytest_junit_counts_and_skip_reasons(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1">'
        '<testcase name="test_a"/><testcase name="test_b"><failure message="boom"/></testcase>'
        '<testcase name="test_syncbn_on_cuda"><skipped message="needs 2 CUDA devices"/></testcase>'
        '<testcase name="test_d"/></testsuite></testsuites>'
    )
    assert gpu_check.parse_junit(report) == (2, 1, 1, ["test_syncbn_on_cuda: needs 2 CUDA devices"])


def test_gpu_check_names_the_exception_not_torchruns_wrapper():
    output = ("Traceback (most recent call last):\n    raise RuntimeError(\"x\")\n"
              "RuntimeError: Distributed package doesn't have NCCL built in\n[rank0]: more\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nlast line\n")  # fmt: skip
    assert gpu_check.last_line(output) == "RuntimeError: Distributed package doesn't have NCCL built in"
    assert gpu_check.last_line("one\ntwo\n") == "two"
