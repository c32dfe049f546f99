"""The layer rule of docs/architecture.md, checked on the import graph of service/ (parsed, nothing imported).

Every import counts: module level, function-local, and those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SERVICE = Path(__file__).resolve().parent.parent / "service"

# Lower layers first; a module may import its own layer and those below it, never one above.
LAYERS = ["base", "world", "state", "telemetry", "data", "model", "loop", "ops", "entry"]
BASE = {"service", "service.early", "service.version"}  # and the service.config package, the service.tasks API
ENTRY = {"service.cli", "service.__main__", "service.entry", "service.worker"}
HANDLERS = ("service.rendezvous.native", "service.rendezvous.dynamic")
RDZV_TOP = {"service.rendezvous.factory", "service.rendezvous.plugin", "service.rendezvous.admin"}
# The root package names the public API of a script's own loop (service.Session, Carry, Preempted), loaded lazily
# (PEP 562): the one edge that runs up the layers, and only to these modules; it is no edge of an import cycle.
PUBLIC_API = {("service", "service.loop.session"), ("service", "service.loop.kept")}


def layer(module: str) -> str:
    if module in BASE or module.split(".")[:2] in (["service", "config"], ["service", "tasks"]):
        return "base"
    if module in ENTRY:
        return "entry"
    if module.startswith("service.rendezvous"):
        return "world"  # how a process joins its world; torchrun loads it through an entry point
    name = module.split(".")[1]
    if name not in LAYERS:
        raise AssertionError(f"{module} sits in no layer: move it into one of the packages docs/architecture.md lists")
    return name


def modules() -> dict[str, Path]:
    found = {}
    for path in SERVICE.rglob("*.py"):
        parts = list(path.relative_to(SERVICE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The service modules that ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    return {m for m in out if m in known and m != module}


def graph() -> dict[str, set[str]]:
    """The import graph, less the root package's lazy names of the public API (``PUBLIC_API``)."""
    found = modules()
    return {m: {d for d in imports(m, p, set(found)) if (m, d) not in PUBLIC_API} for m, p in found.items()}


def test_the_root_package_names_the_public_api_lazily_and_nothing_else_above_it() -> None:
    found = modules()
    upward = {dst for dst in imports("service", found["service"], set(found)) if layer(dst) != "base"}
    assert {("service", dst) for dst in upward} == PUBLIC_API
    import service

    assert service.Session.__module__ == "service.loop.session" and service.Carry.__module__ == "service.loop.kept"


def test_no_module_takes_a_name_from_the_root_package() -> None:
    """The root package reaches up to loop for the public API: a module that takes a name from it (``from service
    import __version__``) climbs through it. It imports the module that defines the name (``service.version``)."""
    found = modules()
    bad = [
        f"{module} takes {alias.name} from the root package: import it from the module that defines it"
        for module, path in sorted(found.items())
        if module != "service"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "service"
        for alias in node.names
        if f"service.{alias.name}" not in found
    ]
    assert not bad, "\n".join(bad)


def test_the_top_level_holds_the_entry_points_and_the_config_alone() -> None:
    """Issue 37: the top of service/ is the program's entry points, the version (a leaf the root package reads
    without climbing) and the config package; everything else sits in a package of its layer."""
    loose = sorted(path.stem for path in SERVICE.glob("*.py") if path.stem not in ("__init__", "__main__"))
    assert loose == ["cli", "early", "entry", "version", "worker"], loose
    assert (SERVICE / "config" / "__init__.py").is_file()


def violation(src: str, dst: str) -> str | None:
    """Why ``src`` may not import ``dst``, or None."""
    if src.startswith("service.tasks") and not dst.startswith("service.tasks"):
        return "service.tasks imports nothing of the service but its own base types"
    if src.startswith("service.rendezvous") and not dst.startswith("service.rendezvous") and dst != "service":
        return "service.rendezvous is loaded by torchrun on its own and imports only itself"
    for own in HANDLERS:
        if src.startswith(own):
            other = next(h for h in HANDLERS if h != own)
            if dst.startswith(other):
                return f"the two rendezvous handlers are independent: {own} may not import {other}"
            if dst in RDZV_TOP:
                return f"a handler may not import what builds or drives it ({dst})"
    a, b = layer(src), layer(dst)
    if LAYERS.index(b) > LAYERS.index(a):
        allowed = ", ".join(LAYERS[: LAYERS.index(a) + 1])
        return f"layer {a!r} may import only itself and the layers below it ({allowed}), not {b!r}"
    return None


def test_no_import_runs_up_a_layer() -> None:
    bad = [
        f"{src} imports {dst}: {why}"
        for src, dsts in sorted(graph().items())
        for dst in sorted(dsts)
        if (why := violation(src, dst))
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    edges = graph()
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles (TYPE_CHECKING and function-local imports count):\n" + "\n".join(cycles)


def test_the_rule_catches_an_upward_import() -> None:
    assert violation("service.world.env", "service.loop.train")
    assert violation("service.state.checkpoint", "service.telemetry.metrics")
    assert violation("service.tasks.shapes", "service.config")
    assert violation("service.rendezvous.native.handler", "service.rendezvous.dynamic.backend")
    assert violation("service.rendezvous.native.handler", "service.rendezvous.factory")
    assert violation("service.loop.train", "service.cli")
    assert violation("service.loop.train", "service.state.resume") is None
    assert violation("service.cli", "service.rendezvous.admin") is None
    try:
        layer("service.stray")
    except AssertionError as exc:
        assert "service.stray sits in no layer" in str(exc)
    else:
        raise AssertionError("a module outside the packages has no layer")


def test_imports_seen_in_functions_and_type_checking(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from service.loop import train\n"
        "def f():\n    from .metrics import EvalReport\n    import service.config\n"
    )
    known = {"service.loop", "service.loop.train", "service.telemetry.metrics", "service.config"}
    assert imports("service.telemetry.m", path, known) == known


def missing_names(path: Path, roots: tuple[str, ...] = ("service",)) -> list[str]:
    """``from <root>... import name`` lines (in functions too) of ``path`` whose module or name no longer exists."""
    import importlib
    import importlib.util

    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in roots):
            continue
        module = importlib.import_module(str(node.module))
        for alias in node.names:
            submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
            if not hasattr(module, alias.name) and not submodule:
                missing.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
    return missing


def test_benches_examples_and_tests_import_only_names_that_still_exist(tmp_path: Path, monkeypatch) -> None:
    """Imports inside functions run only when the function does: a refactor once left bench/metrics_overhead.py
    (which no test runs) importing two names the task loop had dropped, and a test's helper moved from one test
    module to another failed only in the one e2e test that imported it where it ran. Benches import each other's
    helpers too (``paired``, ``snapshot``'s MLP): those names are checked as well."""
    repo, tests = SERVICE.parent, Path(__file__).resolve().parent
    scripts = sorted([*(repo / "bench").glob("*.py"), *(repo / "examples").rglob("*.py")])
    own = tuple(sorted({path.stem for path in tests.glob("*.py")} | {"rendezvous"}))
    benches = tuple(sorted(path.stem for path in (repo / "bench").glob("*.py") if path.stem not in own))
    assert len(scripts) > 10 and "test_prometheus_e2e" in own and "paired" in benches
    assert [name for path in sorted(tests.rglob("*.py")) for name in missing_names(path, ("service", *own))] == []
    monkeypatch.syspath_prepend(str(repo / "bench"))  # where a bench's own imports find each other
    loaded = set(sys.modules)
    try:
        assert [name for path in scripts for name in missing_names(path, ("service", *benches))] == []
    finally:  # the benches' modules (snapshot, paired, ...) leave with the bench path
        for name in set(sys.modules) - loaded:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(repo / "bench")):
                del sys.modules[name]
    stale = tmp_path / "stale.py"
    stale.write_text("def worker():\n    from service.loop.train import _Window, build_job\n"
                     "    from test_prometheus_e2e import Prometheus, free_base_port\n")  # fmt: skip
    assert missing_names(stale, ("service", *own)) == ["stale.py:2 service.loop.train._Window",
                                                       "stale.py:3 test_prometheus_e2e.free_base_port"]  # fmt: skip
    stale_bench = tmp_path / "stale_bench.py"  # bench/overhead.py's task_epoch moved to bench/paired.py
    stale_bench.write_text("def run():\n    from overhead import task_epoch\n    from paired import task_epoch\n")
    assert missing_names(stale_bench, ("service", *benches)) == ["stale_bench.py:2 overhead.task_epoch"]
