"""Warm restarts under ``ddp-service launch``: workers forked from a fork server that has imported torch already.

torchrun's agent starts every worker as a new interpreter (``python -m service train``), so each start and each
restart after a failure paid the interpreter, ``import torch`` (1.45 s of CPU) and the ``torch._dynamo`` that
DDP's constructor imports (1.2 s), for every worker, before a step. ``launch`` has torchrun's own agent run its
workers as a function instead (``--run-path`` with ``--start-method forkserver``: torch.distributed.run's
``start_processes``, no process manager of our own), from a fork server that imports torch, ``torch._dynamo`` and
the service once (``multiprocessing.set_forkserver_preload``), and which the agent starts while it waits in its
first rendezvous. A restarted worker is a fork of it: no interpreter start, none of those imports.

A warm start is a cold one, faster: the fork server never imports the job's task module or a ``--script``
script, so none of a user's module-level code runs there. Each worker imports them itself after the fork, with its
own environment (``RANK``, ``LOCAL_WORLD_SIZE``), ``sys.argv``, cwd and threads, exactly as under torchrun; it
ends as a program does (``sys.excepthook``, the ``atexit`` handlers, its exit code: ``service/worker.py``). The
agent watches each worker on its own pidfd and starts workers cold where the fork server is gone, stopped or
frozen (:mod:`service.ops.watched`), so it learns of an exit within a second whatever the fork server's state.

What stays as it was, checked by the tests: a worker still dies with its agent (the fork server exits when the
agent does, and each worker's parent-death signal follows it), signals and exit codes (75 on preemption), the
run_dir lock's process id (the worker's own), and the node's in-memory snapshots (keyed by the agent, which the
workers learn from ``DDP_SERVICE_AGENT_PID``: their parent is the fork server now). The goodput ledger's
``startup`` of the first start counts from the agent's start, the fork server's imports included. Plain
``torchrun -m service train`` starts its workers as before.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from service import early
from service.ops import watched
from service.world.env import AGENT_PID

log = logging.getLogger("service.ops.launcher")

WORKER = Path(__file__).resolve().parent.parent / "worker.py"  # what each worker runs: service/worker.py
FORK_SERVER = "service.ops.fork_server"  # imported first by the fork server: it ignores the stop signals
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "service.entry", "service.cli", "service.loop.runtime",
           "service.loop.train", "service.loop.session")  # fmt: skip


class _NoJoinTraceback(logging.Filter):
    """torch's agent logs a failed function worker with the traceback of its own ``join`` (ProcessExitedException):
    the worker's exit code is the news (a preemption's 75, a refused input's 2), the agent's stack is not."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith("failed (exitcode"):
            record.exc_info, record.exc_text = None, None
        return True


def warm_workers(namespace: argparse.Namespace) -> None:
    """Have torchrun's agent (its parsed ``namespace``) run the workers as a function from a preloaded fork server:
    ``--run-path service/worker.py [--script PATH] ARGS``, ``--start-method forkserver``; start the fork server now,
    so its imports overlap the agent's rendezvous."""
    import multiprocessing
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker
    import signal

    os.environ[AGENT_PID] = str(os.getpid())  # the fork server and its workers inherit it
    modules = [FORK_SERVER, *PRELOAD]  # never the job's task module or script: each worker imports its own
    multiprocessing.set_forkserver_preload(modules)
    watched.install(tuple(modules))
    args = list(namespace.training_script_args)
    if not namespace.module:  # --script: a script with its own loop
        args = ["--script", str(namespace.training_script), *args]
    namespace.training_script, namespace.training_script_args = str(WORKER), args
    namespace.run_path, namespace.module, namespace.start_method = True, False, "forkserver"
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoJoinTraceback())
    # The fork server (service.ops.fork_server, its first import) and multiprocessing's resource tracker ignore
    # the stop signals that Slurm's scancel and a container's stop send to every process of the step: a fork
    # server ended by one would end its workers before they checkpoint, and a tracker ended so is restarted empty
    # and prints a KeyError traceback for each name it is then asked to forget (it ignores SIGINT and SIGTERM
    # itself). The agent and the workers keep their own handlers.
    with early.ignore_in_children((signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)):
        multiprocessing.resource_tracker.ensure_running()
    multiprocessing.forkserver.ensure_running()
    log.info("launch: workers start from a fork server that imports %s once (warm restarts)", ", ".join(modules))
