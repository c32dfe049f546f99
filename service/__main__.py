"""``python -m service``: :func:`service.entry.main`, as the ``ddp-service`` script runs it."""

from service.entry import main

main()
