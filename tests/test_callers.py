"""No dead public code in service/: every module-level public function and class is named somewhere else in the
tree (a caller in service/, bench/, examples/, launch/, k8s/, pyproject.toml's entry points, or a test). Parsed,
nothing imported."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHERE = ("service", "tests", "bench", "examples", "launch", "k8s")
SUFFIXES = {".py", ".sh", ".sbatch", ".toml", ".yaml", ".yml"}


def test_every_public_function_and_class_of_service_has_a_caller() -> None:
    texts = [path.read_text(errors="replace") for top in WHERE for path in (REPO / top).rglob("*")
             if path.is_file() and path.suffix in SUFFIXES]  # fmt: skip
    texts.append((REPO / "pyproject.toml").read_text())
    words = Counter(word for text in texts for word in re.findall(r"\w+", text))
    dead = []
    for path in sorted((REPO / "service").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            public = not node.name.startswith("_") if hasattr(node, "name") else False
            if public and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if words[node.name] <= 1:  # its own definition alone
                    dead.append(f"{path.relative_to(REPO)}: {node.name}")
    assert not dead, f"public names nothing calls: remove them (or call them): {dead}"
