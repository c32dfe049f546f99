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
  started and nothing lost;
- the workers are forks of a fork server that has imported torch and the
  service once (``service/ops/warm.py``), so a restart after a lost worker
  pays neither an interpreter nor the imports; ``--no-fork-server`` starts
  each as a new interpreter, as torchrun does.

Every other torchrun option passes through unchanged; the options are parsed
by torchrun's own ``get_args_parser()`` and the job runs through
``torch.distributed.run.run`` (``elastic_launch``). The config is validated
before any worker starts. The exit code says how the job ended, from the
workers' exit codes and this start's ``summary.json``: 0 completed, 75
preempted (rerun to resume), 2 bad input, a ``--script``'s own exit code
when every failed worker had it, 1 failed.
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
from service.ops.launch_args import (  # noqa: F401 (re-exported: the parsing's public names)
    DEFAULT_SIGNALS,
    LaunchError,
    LaunchRequest,
    asks_for_help,
    launch_help,
    parse_request,
)
from service.ops.launch_signals import EarlySignals, Signalled, handled_signals, raise_signalled, restore_signals
from service.ops.warm import warm_workers
from service.state.preemption import EXIT_COMPLETED, EXIT_FAILED, EXIT_PREEMPTED
from service.world.env import WorldInfo
from service.world.preflight import check_against_world

log = logging.getLogger("service.ops.launcher")

EXIT_BAD_INPUT = 2


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the workers ended: the exit codes of the failed ones, the signal that stopped the agent, and the
    ``status`` of the ``summary.json`` this start wrote (None when it wrote none, e.g. on another node)."""

    failed_codes: tuple[int, ...] = ()
    signal: str | None = None
    summary_status: str | None = None


def exit_code(outcome: Outcome) -> int:
    """0 completed, 75 preempted (a checkpoint of the step is saved), 2 bad input, a script's own exit code, 1
    failed.

    A signalled agent whose workers wrote no summary (the signal came in
    start-up, in the rendezvous, before any worker reached training, or a
    ``--script`` that never created a Session: nothing was saved, and the
    rerun starts it afresh) is preempted too: nothing failed, and the rerun
    resumes from the newest checkpoint. Workers that all exited with one code
    from 3 to 127 (a script's own ``sys.exit(3)``) give that code; a signal's
    death or codes that differ give 1.
    """
    codes = outcome.failed_codes
    if outcome.summary_status == "preempted" or (codes and all(code == EXIT_PREEMPTED for code in codes)):
        return EXIT_PREEMPTED
    if outcome.signal is not None and not codes and outcome.summary_status is None:
        return EXIT_PREEMPTED
    if EXIT_BAD_INPUT in codes:
        return EXIT_BAD_INPUT
    if len(set(codes)) == 1 and 2 < codes[0] < 128:
        return codes[0]  # the script's own exit code, as its workers had it
    if codes or outcome.signal is not None or outcome.summary_status == "failed":
        return EXIT_FAILED
    return EXIT_COMPLETED


# --------------------------------------------------------------------------- running


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """``ddp-service launch``: validate, run torchrun's agent in this process, and say how the job ended."""
    environ = os.environ if environ is None else environ
    _configure_logging()
    # First thing: loading torch alone takes seconds, and torchrun's agent handles signals only once it has
    # started workers. Until then a handled signal ends the launch as preempted.
    early = handled_signals(environ.get("PET_SIGNALS_TO_HANDLE") or DEFAULT_SIGNALS)
    _import_agent()  # while the signals are only noted (service.early): a raise inside an import breaks modules
    kept = EarlySignals()
    handler = kept.handler(raise_signalled)
    previous = {sig: signal.signal(sig, handler) for sig in early}
    try:
        held.release()  # a signal since the command line's first line reaches the handler above now
        return _launch(argv, environ, previous, kept)
    except Exception as exc:
        if not isinstance(exc, Signalled) and not kept.unhonoured():
            raise
        sigval = exc.sigval if isinstance(exc, Signalled) else kept.received[0]
        if not isinstance(exc, Signalled):  # the raise was swallowed and became this error: the signal is the news
            log.info("launch: %s while stopping for %s", type(exc).__name__, sigval.name)
        log.warning("launch: got %s before torchrun's agent started; no worker ran", sigval.name)
        code = exit_code(Outcome(signal=sigval.name))
        log.info("launch: exit %d (%s)", code, _MEANING.get(code, "the workers' own exit code"))
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: a handler not from Python


def _import_agent() -> None:
    """Load torchrun's agent (torch: a second or more). Signals that come meanwhile are held, not raised: an
    exception raised inside an import can be caught by the module being imported, which then fails later with
    "cannot load module more than once per process" (numpy, seen under load)."""
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.distributed.run  # noqa: F401


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
    log.info("launch: exit %d (%s)", code, _MEANING.get(code, "the workers' own exit code"))
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
    if request.torchrun.fork_server:
        warm_workers(request.torchrun)
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
    entry = ["-m", "service"] if namespace.module else [namespace.training_script]
    if namespace.run_path:
        entry = [f"--start-method={namespace.start_method}", "--run-path", *entry]
    parts += [f"--max-restarts={namespace.max_restarts}", f"--signals-to-handle={namespace.signals_to_handle}",
              *entry, *namespace.training_script_args]  # fmt: skip
    return " ".join(parts)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [launch] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
