"""Task modules that break at import or at build time (tests/test_bad_input.py); the env var picks how."""

from __future__ import annotations

import os
import sys

from service.tasks.base import Task, TaskSpec

if os.environ.get("BROKEN_TASK_AT_IMPORT") == "raise":
    raise RuntimeError("the dataset server is unreachable")
if os.environ.get("BROKEN_TASK_AT_IMPORT") == "exit":
    sys.exit(3)


def raises(spec: TaskSpec) -> Task:
    raise KeyError("image_size")


def exits(spec: TaskSpec) -> Task:
    sys.exit("no GPU, giving up")
