"""Log lines that say which rank wrote them."""

from __future__ import annotations

import logging
import sys


def configure_logging(rank: int, level: int = logging.INFO) -> None:
    """Route the ``service`` loggers to stderr as ``time [rank N] LEVEL message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"))
    logger = logging.getLogger("service")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").handlers[:] = [handler]
