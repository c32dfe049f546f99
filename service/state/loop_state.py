"""Where training stands: :class:`LoopState`, what a checkpoint holds of the loop."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LoopState:
    """Where training stands; what a checkpoint must hold to resume.

    ``cursor`` is the data position: samples of this epoch's permutation that
    optimizer steps have consumed, whatever the world size that consumed them.
    ``completed``: the run ended here as completed (its last step, a script's
    ``break`` or ``sys.exit(0)``): a rerun with the same ``train.max_steps``
    trains nothing (:meth:`~service.loop.runtime.Runtime.plan`).
    """

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    epochs_completed: int = 0
    cursor: int = 0
    dropped_batches: int = 0  # batches an uneven stream's epoch ends left untrained, over every rank
    completed: bool = False
