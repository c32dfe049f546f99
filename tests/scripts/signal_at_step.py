"""Run the script ``SIGNAL_SCRIPT`` (as ``__main__``, with this process's arguments) whose rank 1 sends itself
SIGTERM in step ``SIGNAL_AT_STEP``, at its ``s.log``: a preemption notice reaching one worker at a step the test
names, whatever the machine's load (a test that reads the log and then signals can lag a whole run of fast steps).
"""

import os
import runpy
import signal
import sys

from service.loop.session_tools import SessionTools

AT = int(os.environ["SIGNAL_AT_STEP"])
logged = SessionTools.log


def log_then_signal(self: SessionTools, **scalars: object) -> None:
    logged(self, **scalars)
    if self.rank == 1 and self._rt.in_flight is not None and self.global_step + 1 == AT:
        os.kill(os.getpid(), signal.SIGTERM)


SessionTools.log = log_then_signal  # type: ignore[method-assign]
sys.argv[0] = os.environ["SIGNAL_SCRIPT"]
runpy.run_path(sys.argv[0], run_name="__main__")
