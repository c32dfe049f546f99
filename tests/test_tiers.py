"""The two tiers stay honest: a test without the e2e marker cannot start a process (tests/conftest.py refuses it,
naming the marker), so ``make test-quick`` (``-m "not e2e"``) runs in-process tests alone."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
from conftest import ProcessStartRefused

STARTS = {
    "subprocess.run": lambda: subprocess.run(["true"], check=True),
    "subprocess.check_output": lambda: subprocess.check_output([sys.executable, "-c", "pass"]),
    "multiprocessing.Process": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    "os.system": lambda: os.system("true"),
    "os.posix_spawn": lambda: os.waitpid(os.posix_spawn("/bin/true", ["true"], {}), 0),
}


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_a_test_without_the_e2e_marker_that_starts_a_process_fails_naming_the_marker(start) -> None:
    with pytest.raises(ProcessStartRefused, match=r"no e2e marker: mark it @pytest\.mark\.e2e"):
        start()


@pytest.mark.e2e
def test_an_e2e_test_may_start_processes() -> None:
    assert subprocess.run(["true"]).returncode == 0
    assert os.system("true") == 0
