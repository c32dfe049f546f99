"""What each worker of ``ddp-service launch`` runs, forked from its fork server (:mod:`service.ops.warm`), or
started as a new interpreter where the fork server cannot serve (:mod:`service.ops.watched`): ``python -m service
train ...`` as :func:`service.entry.main` runs it, or, after ``--script PATH``, that script with its own loop
(:func:`service.entry.run_script`). torchrun runs this file with ``runpy`` (``--run-path``).

Like a worker started as a program, it has the stop signals' default actions, multiprocessing's default start
method and its own thread pool size, imports the job's task module or script itself (the fork server preloads only
torch and the service: none of a user's module-level code runs there), and ends as a program ends
(:func:`finish`): ``sys.excepthook`` for an uncaught exception, then the join of the threads it started that are
not daemons (``threading._shutdown``, as an interpreter's finalization does), then the ``atexit`` handlers (a
``Session().start()`` without ``with`` closes there), then the exit code a program would have. After a success
the handlers come first and the threads are joined once the return value has gone to the agent (:func:`finish` says
why). A multiprocessing child runs none of those by itself, or joins its threads only after (its ``_bootstrap``)."""

import atexit
import multiprocessing
import os
import sys
import threading

from service import early

early.hold(defaults=True)  # the fork server ignores the stop signals; a worker keeps them as a new one would
from service.entry import main, run_script  # noqa: E402 (after the signals are held)
from service.world.env import AGENT_PID, STARTED_FOR  # noqa: E402

# The goodput ledger's start-up of a first start counts from the agent's start, as a worker started as a program
# would pay its interpreter and imports after the agent started it: the fork server's imports are made for it.
# A restart counts from its own fork (or start).
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get(AGENT_PID, "").isdigit():
    from service.telemetry.goodput import process_start_time

    agent_started = process_start_time(os.environ[AGENT_PID])
    if agent_started is not None:
        os.environ[STARTED_FOR] = f"{agent_started:.3f}"

# multiprocessing's default start method is the agent's ("forkserver", handed down with the fork); a worker's own
# processes (a DataLoader's workers) start as a new interpreter's would, by this platform's default: a local
# function in a dataset would not pickle for a fork server.
multiprocessing.set_start_method(None, force=True)
# torch's thread pool was sized in the fork server, before torchrun set OMP_NUM_THREADS=1 for several processes per
# node; the worker's environment has it now, and the pool follows it as a new interpreter's would at start.
if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def program_code(exc: SystemExit) -> int:
    """The exit status ``python`` gives a ``SystemExit``: None is 0, an int is itself, anything else is printed to
    stderr and is 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def end_as_a_program() -> None:
    """What an interpreter's finalization runs after the main module, in its order: wait for every thread that is
    not a daemon (``threading._shutdown``: a script's writer thread finishes its file), then the ``atexit``
    handlers. multiprocessing's ``_bootstrap`` calls ``threading._shutdown`` again later, which then returns at
    once."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()


def finish(run: object) -> None:
    """Run ``run()`` and end as a program does. A success returns after the ``atexit`` handlers (torchrun's agent
    counts a function worker done by its return value, sent after this returns: a script's thread that ended the
    process while joined here, as a lingering writer's ``os._exit`` does, would leave the agent waiting for good;
    multiprocessing's ``_bootstrap`` joins the threads once it is sent); an uncaught exception, after
    ``sys.excepthook``, the threads' join and the ``atexit`` handlers, goes on to torch's wrapper (its error file,
    exit 1); a ``SystemExit`` with another code than 0 ends the process with it, after the same join and handlers."""
    try:
        run()  # type: ignore[operator]
    except SystemExit as exc:
        code = program_code(exc)
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.stderr.flush()
        end_as_a_program()
        raise
    else:
        code = 0
    if code == 0:  # the agent counts this worker done by its return value, which goes out only once we return: a
        atexit._run_exitfuncs()  # thread ending the process first (os._exit) would hang it, so multiprocessing's
    else:  # _bootstrap joins the threads after the return here, and the handlers come first
        end_as_a_program()
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        raise SystemExit(code)


# A program's sys.argv[0] is what it ran: the script (run_script sets it), or service's __main__.py for `train`.
if sys.argv[1:2] == ["--script"]:
    finish(lambda: run_script(sys.argv[2], sys.argv[3:]))
else:
    sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
    finish(lambda: main(quick_success=False))
