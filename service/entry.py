"""The program: ``ddp-service`` and ``python -m service``. The stop signals are held from its first line
(:mod:`service.early`), then the command runs, then a quick exit once torch is loaded and nothing is left to
wait for.

With torch (and the ``torch._dynamo`` that DDP imports) loaded, tearing the
interpreter down takes about a second of CPU: every worker of every start paid
it after its summary was written, and a worker whose peer died paid it before
its agent could restart the group. When ``main`` returned or raised (the job
is closed, its lock released, its files and logs flushed; ``@record`` wrote
torchrun's error file) and no child process or non-daemon thread is left,
there is nothing for that teardown to finish, so the process leaves at once
with the same exit code, after the traceback Python would print. Anything else
(a live child or thread, no torch, ``SystemExit``) exits the normal way. The
preemption handlers stay installed to the end: a SIGTERM after ``main`` (an
agent stopping the group once a peer exited 75) only sets their flag.
"""

from __future__ import annotations

from service import early


def main(quick_success: bool = True) -> None:
    """Hold the stop signals, import and run the command (``service.cli``), and leave.

    ``quick_success=False`` (a worker forked by ``launch``'s fork server, a function to torchrun's agent): a
    success returns the normal way, since the agent counts a worker done only once its function has returned;
    a failure or a preemption still leaves at once, with its code."""
    early.hold()  # before the imports (a second or more): a SIGTERM now is kept for the command's own handlers
    import logging
    import multiprocessing
    import os
    import sys
    import threading
    import traceback

    from service.cli import main as command

    def nothing_left() -> bool:
        threads = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
        return "torch" in sys.modules and not threads and not multiprocessing.active_children()

    def leave(code: int) -> None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    try:
        code = command(handlers_until_exit=True)
    except Exception:
        if not nothing_left():
            raise
        traceback.print_exc()
        leave(1)
    if isinstance(code, int) and nothing_left() and (code != 0 or quick_success):
        leave(code)
    sys.exit(code)


SCRIPT_HOLD_SECONDS = 1.0  # how long a held stop signal waits for a script's Session before it ends the script


def run_script(path: str, args: list[str]) -> None:
    """A script with its own loop (``ddp-service launch --script``) in this process, as ``python PATH ARGS`` runs
    it: its folder first on ``sys.path``, run as ``__main__``; the stop signals held until its session has its
    handlers (``service.Session`` releases them), but a signal that no session takes within
    :data:`SCRIPT_HOLD_SECONDS` ends the script as it would without the hold (exit ``128 + signum``): a script
    that never creates a ``Session``, or not yet, stops about as fast as under plain torchrun."""
    early.hold()
    early.give_up_after(SCRIPT_HOLD_SECONDS)
    import os
    import runpy
    import sys

    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")
