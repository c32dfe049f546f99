"""The documents stay true: README.md is a front door of at most 200 lines, every relative link and every named
repository path in README.md and docs/*.md exists, every shell command in README.md's code blocks is run by a
test (the map below says which), and docs/config.md's table has a row for every config key. Files only, no
process."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from service.config import config_keys

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "k8s" / "README.md", REPO / "launch/slurm/README.md"]

# Each shell command in README.md's code blocks -> (what runs it, strings that file must hold: the command's
# parts as the runner spells them). A command must be here, and what runs it must exist.
README_COMMANDS = {
    "make demo": ("make demo", ()),
    "make test": (".ci/run", ("make test",)),
    "PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 -m service train examples/byo.yaml": (
        "tests/test_training_e2e.py::test_bring_your_own_task_from_module_function",
        ('"examples" / "byo.yaml"', "PYTHONPATH=", "'examples'", "run_job(run_dir, 2,"),
    ),
    "ddp-service launch job.yaml --script train.py -- --its-own-args": (
        "tests/test_session_e2e.py::test_a_datasets_stream_with_two_workers_resumes_exactly_and_refuses_another_world_size",
        ('"service", "launch"', '"--script", str(script)', '[*launch, "--", *args]'),
    ),
    "torchrun --nnodes=1:4 --nproc_per_node=4 --rdzv-backend=etcd3 --rdzv-endpoint=etcd-0:2379 --rdzv-id=job42 "
    "--max-restarts=10 -m service train job.yaml": (
        # two loopback nodes of 4 processes each, their agents started with these options (tests/rendezvous/agents.py)
        "tests/test_headline.py::test_two_nodes_of_four_processes_through_etcd3",
        ('run_two_nodes(tmp_path, "etcd3", etcd.endpoint', '"-m", "service", "train"'),
    ),
    "sbatch --time=12:00:00 launch/slurm/train.sbatch job.yaml": (
        "tests/test_slurm.py::test_sbatch_runs_torchrun_on_both_nodes_to_completion",
        ('"launch" / "slurm" / "train.sbatch"', '["sbatch", "--parsable"'),
    ),
    # No cluster here: the test renders the overlay as `kubectl apply -k` would send it (`kubectl kustomize`) and
    # validates every object strictly; tests/test_k8s_pods.py runs the pods' commands as local processes.
    "kubectl apply -k k8s/overlays/cpu": (
        "tests/test_k8s_manifests.py::test_core_kinds_pass_kubernetes_validate_strict",
        ("rendered",),
    ),
}

LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A path under one of the repository's top folders, not inside a URL or another path.
REPO_PATH = re.compile(r"(?<![\w./-])((?:service|tests|bench|examples|launch|k8s|monitoring|docs|\.ci)/[\w./*-]*)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def prose(text: str) -> str:
    """The text without code blocks and inline code (where a link's syntax is no link)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def shell_commands(text: str) -> list[str]:
    """Each command of the sh/bash code blocks: continuation lines joined, comments and spacing dropped."""
    commands = []
    for language, body in FENCE.findall(text):
        if language not in {"sh", "bash", "shell", "console"}:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            command = " ".join(re.split(r"\s#\s|^#", line)[0].split())
            if command:
                commands.append(command)
    return commands


def test_readme_is_a_front_door_of_at_most_200_lines_and_names_where_the_config_table_is() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md is the front door: move the details to docs/ and link them"
    for heading in ("## Start", "## Two doors", "## Launch", "## Exit codes", "## Config"):
        assert f"\n{heading}" in text, heading
    assert "[docs/config.md](docs/config.md)" in text


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_its_anchor_to_a_heading(doc: Path) -> None:
    broken = []
    for text, target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"[{text}]({target}): no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"[{text}]({target}): no heading gives #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: fix or remove these links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_repository_path_a_document_names_exists(doc: Path) -> None:
    missing = []
    for name in sorted(set(REPO_PATH.findall(doc.read_text()))):
        name = name.rstrip(".")
        found = list(REPO.glob(name)) if "*" in name else [REPO / name] if (REPO / name).exists() else []
        if not found:
            missing.append(name)
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist (renamed or removed?): {missing}"


def test_every_shell_command_in_the_readme_is_run_by_a_test() -> None:
    commands = shell_commands(README.read_text())
    unrun = [command for command in commands if command not in README_COMMANDS]
    assert not unrun, (
        f"README.md's commands {unrun} are run by no test: add each to README_COMMANDS (tests/test_docs.py) with "
        "the test that runs it, or write that test"
    )
    stale = sorted(set(README_COMMANDS) - set(commands))
    assert not stale, f"README_COMMANDS lists commands README.md no longer has: {stale}"
    for command, (runner, needles) in README_COMMANDS.items():
        if runner == "make demo":
            assert re.search(r"^demo:", (REPO / "Makefile").read_text(), re.M), command
            continue
        file, _, function = runner.partition("::")
        source = (REPO / file).read_text()
        if function:
            defined = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
            assert function in defined, f"{runner} (which runs {command!r}) does not exist: fix README_COMMANDS"
        for needle in needles:
            assert needle in source, f"{file} no longer holds {needle!r}: does {runner} still run {command!r}?"


def test_the_readmes_python_blocks_are_python() -> None:
    for language, body in FENCE.findall(README.read_text()):
        if language == "python":
            ast.parse(body)


def test_docs_config_has_one_row_for_every_config_key() -> None:
    keys = list(config_keys())
    leaves = {key for key in keys if not any(other.startswith(f"{key}.") for other in keys)}
    rows = re.findall(r"^\| `([\w.]+)` \|", (REPO / "docs" / "config.md").read_text(), re.M)
    assert sorted(set(rows)) == sorted(rows), "docs/config.md has a key twice"
    assert not leaves - set(rows), f"docs/config.md's table has no row for {sorted(leaves - set(rows))}: add one"
    assert not set(rows) - leaves, f"docs/config.md's table names keys the config lacks: {sorted(set(rows) - leaves)}"


def test_docs_cli_names_every_option_of_the_services_own_commands() -> None:
    """Every option of train, validate, env, rdzv, export, goodput and launch's own (torchrun's pass through)."""
    import argparse

    from torch.distributed.run import get_args_parser

    from service.cli import _parser
    from service.ops.launch_args import build_parser

    def options(parser: argparse.ArgumentParser) -> set[str]:
        found = set()
        for action in parser._actions:  # argparse has no public way to list a parser's options
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name not in {"launch", "doctor"}:  # parsed by their own parsers
                        found |= options(sub)
            else:
                found |= {option for option in action.option_strings if option.startswith("--")}
        return found - {"--help"}

    own = options(_parser()) | (options(build_parser({})) - options(get_args_parser()))
    text = (REPO / "docs" / "cli.md").read_text()
    missing = sorted(option for option in own if not re.search(rf"{re.escape(option)}\b", text))
    assert not missing, f"docs/cli.md does not name these options of ddp-service's commands: {missing}"
