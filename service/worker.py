"""What each worker of ``ddp-service launch`` runs, forked from its fork server (:mod:`service.ops.warm`):
``python -m service train ...`` as :func:`service.entry.main` runs it, or, after ``--script PATH``, that script
with its own loop (:func:`service.entry.run_script`). torchrun runs this file with ``runpy`` (``--run-path``).

Like a worker started as a program, it has the stop signals' default actions and multiprocessing's default start
method. A worker run as a function hands an exception to torch's agent, which keeps its text for its own report; a
worker started as a program prints it. So the traceback is printed here first, as ``python`` would, and the
launch's output shows why a worker failed."""

import multiprocessing
import os
import sys
import traceback

from service import early

early.hold(defaults=True)  # the fork server ignores the stop signals; a worker keeps them as a new one would
from service.entry import main, run_script  # noqa: E402 (after the signals are held)
from service.ops import fork_server  # noqa: E402 (imported in the fork server already: its state as at the fork)
from service.world.env import STARTED_FOR  # noqa: E402

# The first start's workers count their start-up from the fork server's start: its imports were made for them, as
# a worker started as a program makes them after its own start (the goodput ledger's start-up, summary.json's).
if fork_server.STARTED is not None and fork_server.FORKS < int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1):
    os.environ[STARTED_FOR] = f"{fork_server.STARTED:.3f}"

# multiprocessing's default start method is the agent's ("forkserver", handed down with the fork); a worker's own
# processes (a DataLoader's workers) start as a new interpreter's would, by this platform's default: a local
# function in a dataset would not pickle for a fork server.
multiprocessing.set_start_method(None, force=True)
# torch's thread pool was sized in the fork server, before torchrun set OMP_NUM_THREADS=1 for several processes per
# node; the worker's environment has it now, and the pool follows it as a new interpreter's would at start.
if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

try:
    if sys.argv[1:2] == ["--script"]:
        run_script(sys.argv[2], sys.argv[3:])
    else:
        main(quick_success=False)  # torchrun's agent counts a worker done once its function returned
except Exception:
    traceback.print_exc()
    sys.stderr.flush()
    raise
