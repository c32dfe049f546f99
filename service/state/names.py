"""A checkpoint directory's file names: ``step-NNNNNNNN.pt`` (a step's state) and ``step-NNNNNNNN.json`` (its
manifest). A leaf: the checkpoint files, the best pointer and the exports all name a step's files through it."""

from __future__ import annotations


def state_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"
