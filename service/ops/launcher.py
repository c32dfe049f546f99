"""``ddp-service launch``: one command for a job, through torch's own launcher.

``ddp-service launch [job.yaml] [--set KEY=VALUE ...] [torchrun options]`` is
``torchrun [torchrun options] -m service train [job.yaml] [--set ...]`` with
the choices a first user would otherwise have to make:

- ``--nproc-per-node auto`` (the default): one process per GPU, or 2 CPU
  processes when there is no GPU (logged);
- no rendezvous option and one node: ``--standalone``;
- SIGUSR1 joins the signals the agent handles (Slurm's ``--signal=USR1@90``):
  torchrun's default list leaves it out, and an unhandled SIGUSR1 kills the
  agent. A handled signal is forwarded to the workers, which checkpoint at the
  next step and exit 75 (``service/state/preemption.py``);
- those signals are handled from the first moment, not only once torchrun has
  started workers (its agent installs its handlers then): one during start-up
  or the first rendezvous ends the launch as preempted (75), with no worker
  started and nothing lost.

Every other torchrun option passes through unchanged; the options are parsed
by torchrun's own ``get_args_parser()`` and the job runs through
``torch.distributed.run.run`` (``elastic_launch``). The config is validated
before any worker starts. The exit code says how the job ended, from the
workers' exit codes and this start's ``summary.json``: 0 completed, 75
preempted (rerun to resume), 2 bad input, 1 failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from service import early as held
from service.config import ConfigError, JobConfig, load_config
from service.ops.launch_signals import EarlySignals, Signalled, handled_signals, raise_signalled, restore_signals
from service.ops.preflight import check_against_world
from service.state.preemption import EXIT_COMPLETED, EXIT_FAILED, EXIT_PREEMPTED
from service.world.env import WorldInfo

log = logging.getLogger("service.ops.launcher")

EXIT_BAD_INPUT = 2
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

    def train_args(self) -> list[str]:
        """The arguments of ``python -m service``: ``train [job.yaml] [--set ...]``."""
        args = ["train", *([self.config_path] if self.config_path else [])]
        for override in self.overrides:
            args += ["--set", override]
        return args


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the workers ended: the exit codes of the failed ones, the signal that stopped the agent, and the
    ``status`` of the ``summary.json`` this start wrote (None when it wrote none, e.g. on another node)."""

    failed_codes: tuple[int, ...] = ()
    signal: str | None = None
    summary_status: str | None = None


def exit_code(outcome: Outcome) -> int:
    """0 completed, 75 preempted (a checkpoint of the step is saved), 2 bad input, 1 failed.

    A signalled agent whose workers wrote no summary (the signal came in
    start-up, in the rendezvous, or before any worker reached training) is
    preempted too: nothing failed, and the rerun resumes from the newest
    checkpoint.
    """
    codes = outcome.failed_codes
    if outcome.summary_status == "preempted" or (codes and all(code == EXIT_PREEMPTED for code in codes)):
        return EXIT_PREEMPTED
    if outcome.signal is not None and not codes and outcome.summary_status is None:
        return EXIT_PREEMPTED
    if EXIT_BAD_INPUT in codes:
        return EXIT_BAD_INPUT
    if codes or outcome.signal is not None or outcome.summary_status == "failed":
        return EXIT_FAILED
    return EXIT_COMPLETED


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
    # torchrun reads PET_<OPTION> as the default of each option (a PyTorchJob sets them); those still win.
    if "PET_NPROC_PER_NODE" not in environ:
        parser.set_defaults(nproc_per_node="auto")
    if "PET_SIGNALS_TO_HANDLE" not in environ:
        parser.set_defaults(signals_to_handle=DEFAULT_SIGNALS)
    return parser


_USAGE = "ddp-service launch [job.yaml] [--set KEY=VALUE ...] [--nproc-per-node auto|N] [torchrun options]"
_ADDS = """\
Run the job under torchrun's agent in one command: torchrun [torchrun options] -m service train
[job.yaml] [--set ...], with what a first user would otherwise have to choose:

  - --nproc-per-node auto (the default): one process per GPU, or 2 CPU processes without a GPU;
  - one node and no rendezvous option: --standalone;
  - SIGUSR1 (Slurm's --signal=USR1@90) joins the signals torchrun handles, from the first moment:
    the workers checkpoint at the next step and the launch exits 75;
  - the config is validated before any worker starts;
  - one exit code for the job: 0 completed, 75 preempted (rerun the same command to resume),
    2 bad input (a bad config or option, or a worker that refused its input), 1 failed.
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
    group.add_argument("--nproc-per-node", metavar="auto|N", help="processes on this node; auto (the default): "
                       "one per GPU, else 2 CPU processes; also torchrun's words (gpu, cpu)")  # fmt: skip
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


def parse_request(argv: Sequence[str], environ: Mapping[str, str]) -> LaunchRequest:
    """Split the job file and ``--set`` from torchrun's options, wherever each stands on the line."""
    parser = build_parser(environ)
    namespace = argparse.Namespace()
    config_path: str | None = None
    rest = list(argv)
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
                f"{flag} is not a launch option: launch always runs `python -m service train`. Use torchrun "
                "directly to run another program."
            )
    notes = [*_resolve_nproc(namespace, environ), *_resolve_rendezvous(namespace)]
    if namespace.max_restarts < 0:
        raise LaunchError(f"--max-restarts={namespace.max_restarts} is negative; give 0 or more.")
    namespace.module = True
    namespace.training_script = "service"
    request = LaunchRequest(config_path, tuple(namespace.overrides), namespace, tuple(notes))
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


# --------------------------------------------------------------------------- running


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """``ddp-service launch``: validate, run torchrun's agent in this process, and say how the job ended."""
    environ = os.environ if environ is None else environ
    _configure_logging()
    # First thing: loading torch alone takes seconds, and torchrun's agent handles signals only once it has
    # started workers. Until then a handled signal ends the launch as preempted.
    early = handled_signals(environ.get("PET_SIGNALS_TO_HANDLE") or DEFAULT_SIGNALS)
    kept = EarlySignals()
    handler = kept.handler(raise_signalled)
    previous = {sig: signal.signal(sig, handler) for sig in early}
    try:
        held.release()  # a signal since the command line's first line reaches the handler above now
        return _launch(argv, environ, previous, kept)
    except Signalled as exc:
        log.warning("launch: got %s before torchrun's agent started; no worker ran", exc.sigval.name)
        code = exit_code(Outcome(signal=exc.sigval.name))
        log.info("launch: exit %d (%s)", code, _MEANING[code])
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: a handler not from Python


def _launch(argv: Sequence[str], environ: Mapping[str, str], early: Mapping[signal.Signals, Any],
            kept: EarlySignals) -> int:  # fmt: skip
    if asks_for_help(argv):
        print(launch_help(), end="")
        return EXIT_COMPLETED
    try:
        request = parse_request(argv, environ)
        for sig in set(early) - set(handled_signals(request.torchrun.signals_to_handle)):
            signal.signal(sig, early[sig] or signal.SIG_DFL)  # an explicit --signals-to-handle left it out
        config = load_config(request.config_path, request.overrides)
        nproc = int(request.torchrun.nproc_per_node)
        check_against_world(config, WorldInfo(launcher="torchrun", world_size=nproc, local_world_size=nproc))
    except (ConfigError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in request.notes:
        log.info("%s", note)
    code = exit_code(run_agent(request, config, kept))
    log.info("launch: exit %d (%s)", code, _MEANING[code])
    return code


_MEANING = {EXIT_COMPLETED: "completed", EXIT_PREEMPTED: "preempted: rerun the same command to resume",
            EXIT_BAD_INPUT: "bad input: fix what the error above names, then rerun", EXIT_FAILED: "failed"}  # fmt: skip


def run_agent(request: LaunchRequest, config: JobConfig, kept: EarlySignals | None = None) -> Outcome:
    """Run ``torch.distributed.run.run`` here; its errors become an :class:`Outcome`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    def raise_in_agent(signum: int) -> None:
        """What torchrun's agent installs once it starts workers; here from before its first rendezvous."""
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    kept = kept or EarlySignals()
    started = time.time()
    summary = Path(config.run_dir) / "summary.json"
    handler = kept.handler(raise_in_agent)
    for sig in handled_signals(request.torchrun.signals_to_handle):
        signal.signal(sig, handler)
    kept.check()  # a signal whose raise was lost while torch loaded: no agent, no worker
    log.info("launch: torchrun %s", _describe(request.torchrun))
    done = threading.Event()
    watcher = threading.Thread(target=kept.redeliver, args=(done,), name="launch-signals", daemon=True)
    watcher.start()
    try:
        run(request.torchrun)
    except ChildFailedError as exc:
        codes = tuple(failure.exitcode for failure in exc.failures.values())
        return Outcome(failed_codes=codes, summary_status=_fresh_status(summary, started))
    except SignalException as exc:
        kept.honoured = True
        log.warning("launch: the agent got %s and passed it to the workers", exc.sigval.name)
        return Outcome(signal=exc.sigval.name, summary_status=_fresh_status(summary, started))
    except ValueError as exc:  # torchrun's and the rendezvous backends' refusals of their options
        log.error("launch: torchrun refused its options: %s", exc)
        return Outcome(failed_codes=(EXIT_BAD_INPUT,))
    except RendezvousError as exc:  # unreachable, timed out, closed: the message names the endpoint
        log.error("launch: the rendezvous failed: %s", exc)
        return Outcome(failed_codes=(EXIT_FAILED,))
    finally:
        done.set()
        watcher.join()
        restore_signals(request.torchrun.signals_to_handle)
        remove_snapshots(config)
    return Outcome(summary_status=_fresh_status(summary, started))


def remove_snapshots(config: JobConfig) -> None:
    """The agent is done (completed, preempted, failed, or out of restarts): its workers' in-memory snapshots
    have no reader left (a new launch is another agent, with areas of its own), however the workers ended,
    SIGKILLed and hung ones included."""
    from service.state.snapshot import areas_of_agent

    for area in areas_of_agent(config.checkpoint.snapshot_dir, os.getpid()):
        area.remove()
        log.info("launch: removed this node's in-memory snapshots of the job, %s", area.path)


def _fresh_status(summary: Path, since: float) -> str | None:
    """``status`` of a summary written by this start (not one left by an earlier run), else None."""
    try:
        if summary.stat().st_mtime < since - 1:
            return None
        return str(json.loads(summary.read_text()).get("status"))
    except (OSError, ValueError):
        return None


def _describe(namespace: argparse.Namespace) -> str:
    parts = [f"--nnodes={namespace.nnodes}", f"--nproc-per-node={namespace.nproc_per_node}"]
    if namespace.standalone:
        parts.append("--standalone")
    else:
        parts += [f"--rdzv-backend={namespace.rdzv_backend}", f"--rdzv-endpoint={namespace.rdzv_endpoint}"]
    parts += [f"--max-restarts={namespace.max_restarts}", f"--signals-to-handle={namespace.signals_to_handle}",
              "-m", "service", *namespace.training_script_args]  # fmt: skip
    return " ".join(parts)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [launch] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
