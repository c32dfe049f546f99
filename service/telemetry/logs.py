"""Log lines that say which rank wrote them; rank 0's alone, unless ``logging.all_ranks``."""

from __future__ import annotations

import logging
import sys


def log_level(rank: int, all_ranks: bool) -> int:
    """INFO on rank 0 (or every rank with ``logging.all_ranks``); WARNING elsewhere: warnings and errors only."""
    return logging.INFO if rank == 0 or all_ranks else logging.WARNING


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
