"""``ddp-service launch``'s command line: the job file, ``--set``, ``--script`` and torchrun's own options, split.

Everything but the job file, ``--set``, ``--script PATH`` (a script with its own loop) and the script's arguments
after ``--`` passes to torchrun unchanged, parsed by torchrun's own ``get_args_parser()``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

CPU_PROCESSES = 2  # --nproc-per-node auto without a GPU
EXTRA_SIGNALS = ("SIGUSR1",)
DEFAULT_SIGNALS = ",".join(("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *EXTRA_SIGNALS))
# A token no one types: it ends the argument list, so torchrun's parser, whose first positional takes the
# rest of the line, can be run again on what follows the job file.
_END = "\x00end-of-arguments"
_ENTRYPOINT_OPTIONS = {"module": "-m/--module", "no_python": "--no-python", "run_path": "--run-path"}
_RENDEZVOUS_OPTIONS = {"rdzv_endpoint": "", "rdzv_id": "none", "master_port": None}


class LaunchError(ValueError):
    """The launch command line cannot work; the message names the option and the fix."""


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """What ``launch`` was asked for: the job (file and overrides) and torchrun's parsed options."""

    config_path: str | None
    overrides: tuple[str, ...]
    torchrun: argparse.Namespace
    notes: tuple[str, ...] = ()
    script: str | None = None  # --script: a script with its own loop (service.Session), instead of a task job
    script_args: tuple[str, ...] = ()  # what follows ``--``: the script's own arguments

    def train_args(self) -> list[str]:
        """The arguments of ``python -m service``: ``train [job.yaml] [--set ...]``; with ``--script``, the
        script's: ``[--config job.yaml] [--set ...] [its own arguments]`` (the session takes the first two)."""
        if self.script is not None:
            args = ["--config", self.config_path] if self.config_path else []
        else:
            args = ["train", *([self.config_path] if self.config_path else [])]
        for override in self.overrides:
            args += ["--set", override]
        return [*args, *self.script_args]


# --------------------------------------------------------------------------- the command line


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """torchrun's own parser, plus ``--set``; ``--nproc-per-node`` defaults to ``auto``."""
    from torch.distributed.run import get_args_parser

    parser = argparse.ArgumentParser(
        prog="ddp-service launch",
        usage=_USAGE,
        description=__doc__.splitlines()[0],
        epilog="The positional argument torchrun calls training_script is the job file here (optional: without "
        "it, the embedded defaults); launch always runs `python -m service train`. Exit codes: 0 completed, "
        "75 preempted (rerun to resume), 2 bad input, 1 failed.",
        parents=[get_args_parser()],
        add_help=False,  # the parent's -h/--help
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, as in `ddp-service train` (repeatable)")  # fmt: skip
    parser.add_argument("--no-fork-server", dest="fork_server", action="store_false", help=_NO_FORK_SERVER)
    # torchrun reads PET_<OPTION> as the default of each option (a PyTorchJob sets them); those still win.
    if "PET_NPROC_PER_NODE" not in environ:
        parser.set_defaults(nproc_per_node="auto")
    if "PET_SIGNALS_TO_HANDLE" not in environ:
        parser.set_defaults(signals_to_handle=DEFAULT_SIGNALS)
    return parser


_NO_FORK_SERVER = (
    "start every worker as a new interpreter, as torchrun does, instead of forking it from launch's "
    "fork server, which has imported torch and the service once (warm starts and restarts)"
)
_USAGE = (
    "ddp-service launch [job.yaml] [--set KEY=VALUE ...] [--script train.py [-- ARGS]] [--nproc-per-node auto|N] "
    "[torchrun options]"
)
_ADDS = """\
Run the job under torchrun's agent in one command: torchrun [torchrun options] -m service train
[job.yaml] [--set ...] (or, with --script train.py, your script: train.py [--config job.yaml]
[--set ...] [ARGS after --]), with what a first user would otherwise have to choose:

  - --nproc-per-node auto (the default): one process per GPU, or 2 CPU processes without a GPU;
  - one node and no rendezvous option: --standalone;
  - SIGUSR1 (Slurm's --signal=USR1@90) joins the signals torchrun handles, from the first moment:
    the workers checkpoint at the next step and the launch exits 75;
  - the config is validated before any worker starts;
  - workers forked from a fork server that has imported torch and the service once, so a restart
    after a lost worker pays no interpreter start and no imports (--no-fork-server: torchrun's way);
  - one exit code for the job: 0 completed, 75 preempted (rerun the same command to resume),
    2 bad input (a bad config or option, or a worker that refused its input), a --script's own
    exit code when every failed worker had it, 1 failed.
"""


def asks_for_help(argv: Sequence[str]) -> bool:
    """-h or --help anywhere on the line, but not as the value of a ``--set``."""
    return any(arg in ("-h", "--help") and (index == 0 or argv[index - 1] != "--set")
               for index, arg in enumerate(argv))  # fmt: skip


def launch_help() -> str:
    """launch's own usage and options first, then torchrun's options, which pass through unchanged."""
    from torch.distributed.run import get_args_parser

    own = argparse.ArgumentParser(prog="ddp-service launch", usage=_USAGE, description=_ADDS, add_help=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    group = own.add_argument_group("launch's own arguments")
    group.add_argument("job.yaml", nargs="?", help="the job file; omitted: the embedded defaults (the demo)")
    group.add_argument("--set", metavar="KEY=VALUE", help="override one config key, as in `ddp-service train` "
                       "(repeatable): --set train.lr=0.1")  # fmt: skip
    group.add_argument(
        "--script",
        metavar="PATH",
        help="run this script (its own loop, on service.Session) instead "
        "of the task job; it gets --config job.yaml and the --set options, and what follows `--`",
    )
    group.add_argument("--nproc-per-node", metavar="auto|N", help="processes on this node; auto (the default): "
                       "one per GPU, else 2 CPU processes; also torchrun's words (gpu, cpu)")  # fmt: skip
    group.add_argument("--no-fork-server", action="store_true", help=_NO_FORK_SERVER)
    group.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    torchrun = get_args_parser()
    hidden = {"help", "nproc_per_node", *_ENTRYPOINT_OPTIONS}  # launch's own above, or refused by launch
    for action in torchrun._actions:  # argparse has no public way to list a parser's options
        if not action.option_strings or action.dest in hidden:
            action.help = argparse.SUPPRESS  # the script and its arguments are launch's job file and --set
    options = argparse.ArgumentParser(prog="torchrun", usage=argparse.SUPPRESS, add_help=False, parents=[torchrun])
    options.description = ("torchrun's options, passed through unchanged (torchrun --help says the same; "
                           "PET_<OPTION> environment variables still set their defaults):")  # fmt: skip
    return f"{own.format_help()}\n{options.format_help()}"


def split_script(argv: Sequence[str]) -> tuple[list[str], str | None, list[str]]:
    """``--script PATH`` and what follows ``--`` (the script's own arguments) out of launch's line."""
    items, script, own = list(argv), None, []
    if "--" in items:
        cut = items.index("--")
        items, own = items[:cut], items[cut + 1 :]
    kept: list[str] = []
    index = 0
    while index < len(items):
        name, sep, value = items[index].partition("=")
        if name == "--script":
            if not sep:
                index += 1
                if index >= len(items):
                    raise LaunchError("--script needs the path of a script, e.g. --script train.py")
                value = items[index]
            script = value
        else:
            kept.append(items[index])
        index += 1
    if own and script is None:
        raise LaunchError(f"{' '.join(own)!r} follows `--`, which passes arguments to a --script; without "
                          "--script, launch runs a task job (change its config with --set KEY=VALUE).")  # fmt: skip
    return kept, script, own


def parse_request(argv: Sequence[str], environ: Mapping[str, str]) -> LaunchRequest:
    """Split the job file and ``--set`` from torchrun's options, wherever each stands on the line; ``--script``
    runs a script with its own loop (``service.Session``) instead of ``python -m service train``."""
    parser = build_parser(environ)
    namespace = argparse.Namespace()
    config_path: str | None = None
    rest, script, script_args = split_script(argv)
    if script is not None and not Path(script).is_file():
        raise LaunchError(f"--script {script}: no such file; give the path of your training script.")
    while True:
        namespace = parser.parse_args([*rest, _END], namespace=namespace)
        if namespace.training_script == _END:
            break
        if config_path is not None:
            raise LaunchError(
                f"Two job files were given, {config_path!r} and {namespace.training_script!r}; launch runs one "
                "job: give one file and change single keys with --set KEY=VALUE."
            )
        config_path = namespace.training_script
        rest = namespace.training_script_args[:-1]
    for dest, flag in _ENTRYPOINT_OPTIONS.items():
        if getattr(namespace, dest):
            raise LaunchError(
                f"{flag} is not a launch option: launch runs `python -m service train`, or your script with "
                "--script train.py (a script with its own loop, on service.Session). Use torchrun directly to run "
                "another program."
            )
    notes = [*_resolve_nproc(namespace, environ), *_resolve_rendezvous(namespace)]
    if namespace.max_restarts < 0:
        raise LaunchError(f"--max-restarts={namespace.max_restarts} is negative; give 0 or more.")
    namespace.module = script is None
    namespace.training_script = script if script is not None else "service"
    request = LaunchRequest(config_path, tuple(namespace.overrides), namespace, tuple(notes), script,
                            tuple(script_args))  # fmt: skip
    namespace.training_script_args = request.train_args()
    return request


def _resolve_nproc(namespace: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """``auto``: the GPU count, or 2 CPU processes; other torchrun words (gpu, cpu) as torchrun reads them."""
    raw = str(namespace.nproc_per_node).strip()
    if raw == "auto":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        count = gpus or CPU_PROCESSES
        namespace.nproc_per_node = str(count)
        if gpus:
            return [f"--nproc-per-node auto: {gpus} GPU(s) visible, one process each (NCCL)."]
        return [f"--nproc-per-node auto: no GPU visible, so {CPU_PROCESSES} CPU processes (gloo); "
                "--nproc-per-node N sets another count."]  # fmt: skip
    if raw.lstrip("-").isdigit():
        if int(raw) < 1:
            raise LaunchError(f"--nproc-per-node={raw} must be at least 1 (or auto).")
        return []
    from torch.distributed.run import determine_local_world_size

    try:
        namespace.nproc_per_node = str(determine_local_world_size(raw))
    except ValueError as exc:
        raise LaunchError(
            f"--nproc-per-node={raw!r} is not a process count: give auto, a number, gpu or cpu ({exc})."
        ) from None
    return []


def _resolve_rendezvous(namespace: argparse.Namespace) -> list[str]:
    """No rendezvous option on one node: ``--standalone``; everything else stays as torchrun reads it."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        min_nodes, max_nodes = parse_min_max_nnodes(namespace.nnodes)
    except (ValueError, RuntimeError):
        raise LaunchError(
            f"--nnodes={namespace.nnodes!r} is not a node count: give N or MIN:MAX, e.g. --nnodes=2 or --nnodes=1:4."
        ) from None
    if not 0 < min_nodes <= max_nodes:
        raise LaunchError(f"--nnodes={namespace.nnodes!r} needs 0 < MIN <= MAX, e.g. --nnodes=1:4.")
    given = (
        namespace.standalone
        or namespace.rdzv_backend != "static"
        or any(getattr(namespace, dest) != default for dest, default in _RENDEZVOUS_OPTIONS.items())
    )
    if given or max_nodes > 1:
        return []
    namespace.standalone = True
    return ["one node and no rendezvous option: --standalone (a c10d store on a free local port)."]
