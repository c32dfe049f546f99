"""Imported first by ``launch``'s fork server (its preload, :mod:`service.ops.warm`): the fork server ignores the
stop signals. Slurm's ``scancel`` and a container's stop signal every process of the step or the pod, and a fork
server ended by one would end every worker through its parent-death signal before it could checkpoint. The
workers it forks set their own handlers at their first line (``service/worker.py``).

It also keeps what a worker needs to count its start-up as a worker started as a program would: the fork server's
own start (:data:`STARTED`) and how many workers it had forked before (:data:`FORKS`, inherited by each fork). The
first ``LOCAL_WORLD_SIZE`` workers are the first start's, and its imports were made for them."""

import os

from service import early

early.ignore()

from service.telemetry.goodput import process_start_time  # noqa: E402 (after the signals are ignored)

STARTED = process_start_time()  # this fork server's start (Unix seconds), or None without /proc
FORKS = 0  # in the fork server: the workers forked so far; in a worker: those forked before it


def _forked() -> None:
    global FORKS
    FORKS += 1


os.register_at_fork(after_in_parent=_forked)
