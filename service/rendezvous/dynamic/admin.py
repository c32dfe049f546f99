"""What ``ddp-service rdzv`` reads of torch's pickled rendezvous state: a restricted unpickler that
loads only the classes such a state is made of.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from service.rendezvous.dynamic.signing import ALLOWED_GLOBALS

# What unpickling garbage raises besides UnpicklingError.
_GARBAGE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, RecursionError)  # fmt: skip


class AdminError(Exception):
    """A refusal or failure of an admin command, worded for the operator."""


# -- decoding the state ------------------------------------------------------------
class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"the state refers to {module}.{name}, which a rendezvous state never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("the state holds a persistent id, which a rendezvous state never holds")


def load_state(data: bytes, key: str) -> Any:
    """Unpickle a rendezvous state with the restricted unpickler; ``AdminError`` names the key on refusal."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401  (the allowed classes)

    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
    except _GARBAGE as exc:
        raise AdminError(
            f"The rendezvous state under {key} is not a torch rendezvous state ({exc}); refusing it."
        ) from None
    if type(state).__name__ != "_RendezvousState":
        raise AdminError(f"The rendezvous state under {key} holds a {type(state).__name__}, not a rendezvous state.")
    return state
