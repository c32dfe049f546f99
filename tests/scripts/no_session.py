"""A script that never creates a ``service.Session``, for ``ddp-service launch --script``: its last argument is
``sleep`` (print ``ready``, then sleep for ten minutes) or an exit code (``sys.exit`` with it at once)."""

import sys
import time

if sys.argv[-1] != "sleep":
    sys.exit(int(sys.argv[-1]))
print("ready", flush=True)
time.sleep(600)
