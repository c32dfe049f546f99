"""ddp-service: elastic multi-node PyTorch DDP training.

Kept import-light: torchrun imports ``service.rendezvous`` through an entry point, so the public names of a
script's own loop (:class:`Session`, :class:`Carry`, :class:`Variables`, :class:`Preempted`) are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.version import __version__

__all__ = ["Carry", "Preempted", "Session", "Variables", "__version__"]

if TYPE_CHECKING:
    from service.loop.kept import Carry, Variables
    from service.loop.session import Preempted, Session

_PUBLIC = {
    "Session": "service.loop.session",
    "Preempted": "service.loop.session",
    "Carry": "service.loop.kept",
    "Variables": "service.loop.kept",
}


def __getattr__(name: str) -> Any:
    """``service.Session`` and friends, imported when first asked for (PEP 562)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'service' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
