"""The Makefile's front: `make help` lists every target from its `##` lines, `make test-quick` is the suite less
the e2e tests, `make test` the whole suite, and CI runs `make test`. Runs make itself (dry runs but for help)."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e  # make is a process


def make(*args: str) -> str:
    done = subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_help_lists_every_target_that_has_a_help_line_and_a_bare_make_prints_it() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = re.findall(r"^## ([a-z-]+):", makefile, re.M)
    assert {"help", "demo", "test", "test-quick", "lint", "bench", "install", "clean"} <= set(targets)
    listed = re.findall(r"^  ([a-z-]+) +\S", make("help"), re.M)
    assert listed == targets
    assert make() == make("help")
    for target in targets:  # every documented target exists
        assert re.search(rf"^{target}:", makefile, re.M), target


def test_test_quick_leaves_the_e2e_tests_out_and_test_runs_the_whole_suite_under_ci() -> None:
    quick = [line for line in make("-n", "test-quick").splitlines() if " -m pytest " in line]
    whole = [line for line in make("-n", "test").splitlines() if " -m pytest " in line]
    assert len(quick) == 1 and '-m "not e2e"' in quick[0], quick
    assert len(whole) == 1 and " -m " not in whole[0].split(" -m pytest ", 1)[1], whole
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), re.M)
