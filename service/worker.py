"""What each worker of ``ddp-service launch`` runs, forked from its fork server (:mod:`service.ops.warm`):
``python -m service train ...`` as :func:`service.entry.main` runs it, or, after ``--script PATH``, that script
with its own loop (:func:`service.entry.run_script`). torchrun runs this file with ``runpy`` (``--run-path``)."""

import sys

from service.entry import main, run_script

if sys.argv[1:2] == ["--script"]:
    run_script(sys.argv[2], sys.argv[3:])
else:
    main(quick_success=False)  # torchrun's agent counts a worker done once its function returned
