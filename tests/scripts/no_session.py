"""A script that never creates a ``service.Session``, for ``ddp-service launch --script``: its last argument is
``sleep`` (print ``ready``, then sleep for ten minutes) or an exit code (``sys.exit`` with it at once). With
``ENDS_FILE=PATH`` in its environment, the script first starts a thread that is not a daemon, which writes
``thread`` into PATH.RANK half a second later, and registers an ``atexit`` handler that writes ``atexit`` there;
a program joins that thread before its ``atexit`` handlers run, so the file reads ``thread atexit``."""

import atexit
import os
import sys
import threading
import time


def note(what: str) -> None:
    with open(f"{os.environ['ENDS_FILE']}.{os.environ.get('RANK', '0')}", "a") as out:
        out.write(f"{what} ")


if os.environ.get("ENDS_FILE"):
    threading.Thread(target=lambda: (time.sleep(0.5), note("thread")), name="writer").start()
    atexit.register(note, "atexit")
if sys.argv[-1] != "sleep":
    sys.exit(int(sys.argv[-1]))
print("ready", flush=True)
time.sleep(600)
