"""The stored form of the rendezvous state: an envelope, optionally HMAC-signed, always type-checked.

torch's handler unpickles whatever bytes the backend returns, so whoever can
write the rendezvous key could run code in every agent. Two layers stop that
before the bytes reach ``pickle.loads``:

1. With a shared secret the backend signs each state and refuses a state whose
   signature fails.
2. With or without a secret, the state is loaded once by a restricted
   unpickler that resolves only the classes torch's ``_RendezvousState`` is
   made of; any other global (``os.system``, ``builtins.eval``, ...) is
   refused before it is called, and so is anything that is not a
   ``_RendezvousState``.

A random nonce in every envelope also lets the backend recognise its own write
after an uncertain (timed-out) transaction.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
from typing import Any

MAGIC = b"ddp-etcd3-rdzv\x01"
_SIGNED = b"S"
_UNSIGNED = b"U"
_NONCE_BYTES = 16
_MAC_BYTES = hashlib.sha256().digest_size

_TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# Every global a pickled ``_RendezvousState`` needs, found by pickling real states
# (participants, wait and redundancy lists, heartbeats, deadlines, naive and aware
# datetimes) with protocols 2 to 5. ``_codecs.encode`` is how protocol 2 stores the
# bytes inside a datetime; ``__builtin__`` is protocol 2's name for ``builtins``.
ALLOWED_GLOBALS = frozenset(
    {
        (_TORCH_MODULE, "_RendezvousState"),
        (_TORCH_MODULE, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("__builtin__", "set"),
        ("__builtin__", "frozenset"),
        ("_codecs", "encode"),
    }
)


class StateIntegrityError(ValueError):
    """The stored bytes are not a state this backend may hand to torch."""


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class _StateUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``ALLOWED_GLOBALS``; nothing else is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise _ForbiddenGlobal(f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _ForbiddenGlobal("a persistent id")


def check_state_pickle(state: bytes, where: str) -> None:
    """Raise ``StateIntegrityError`` unless ``state`` unpickles to a plain ``_RendezvousState``.

    ``where`` names the run and the key for the message. The loaded object is
    thrown away; torch unpickles the same bytes itself afterwards.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    try:
        loaded = _StateUnpickler(io.BytesIO(state)).load()
    except _ForbiddenGlobal as exc:
        raise StateIntegrityError(
            f"The rendezvous state {where} refers to {exc}, which a torch rendezvous state never "
            "contains; it was refused unloaded, because unpickling it could run code. Someone "
            "wrote this key who should not be able to: restrict write access to the key prefix, "
            "and set 'secret_file' on every agent."
        ) from None
    except Exception as exc:  # noqa: BLE001  # damaged bytes raise many types: EOFError, KeyError, ...
        raise StateIntegrityError(
            f"The rendezvous state {where} is not a valid pickled torch rendezvous state "
            f"({type(exc).__name__}: {exc}); it is refused."
        ) from None
    if type(loaded) is not _RendezvousState:
        raise StateIntegrityError(
            f"The rendezvous state {where} holds a {type(loaded).__name__}, not a torch "
            "rendezvous state; it is refused."
        )


class StateCodec:
    """Wraps and unwraps state bytes; signs them when a secret is configured.

    Every decoded state passes the restricted-unpickler check; there is no way
    to turn it off. ``run_id`` only names the run in messages.
    """

    def __init__(self, secret: bytes | None, run_id: str | None = None) -> None:
        self._secret = secret
        self._run_id = run_id

    @property
    def secret(self) -> bytes | None:
        """The signing secret (for the native handler's records, which share it)."""
        return self._secret

    @property
    def signs(self) -> bool:
        """Whether this codec signs and verifies."""
        return self._secret is not None

    def encode(self, state: bytes, key: bytes) -> bytes:
        """Envelope ``state`` for ``key``; the key is signed too, so states cannot move between runs."""
        nonce = os.urandom(_NONCE_BYTES)
        if self._secret is None:
            return MAGIC + _UNSIGNED + nonce + state
        return MAGIC + _SIGNED + nonce + self._mac(self._secret, key, nonce, state) + state

    def decode(self, blob: bytes, key: bytes) -> bytes:
        """Return the state inside ``blob`` or raise ``StateIntegrityError``.

        Order: envelope, then the HMAC (with a secret), then the restricted
        unpickler; only bytes that pass all three are returned.
        """
        state = self._unwrap(blob, key)
        check_state_pickle(state, self._where(key))
        return state

    def _where(self, key: bytes) -> str:
        run = f"of run '{self._run_id}' " if self._run_id else ""
        return f"{run}under etcd key '{key.decode(errors='replace')}'"

    def _unwrap(self, blob: bytes, key: bytes) -> bytes:
        where = self._where(key)
        header = len(MAGIC) + 1 + _NONCE_BYTES
        if len(blob) < header or not blob.startswith(MAGIC):
            raise StateIntegrityError(f"The rendezvous state {where} is corrupt: it lacks the etcd3 backend's header.")
        kind = blob[len(MAGIC) : len(MAGIC) + 1]
        nonce = blob[len(MAGIC) + 1 : header]
        if kind == _UNSIGNED:
            if self._secret is not None:
                raise StateIntegrityError(
                    f"The rendezvous state {where} is not signed, but this agent has a signing "
                    "secret; refusing it. Give every agent the same secret."
                )
            return blob[header:]
        if kind != _SIGNED or len(blob) < header + _MAC_BYTES:
            raise StateIntegrityError(f"The rendezvous state {where} is corrupt: its header is unknown.")
        if self._secret is None:
            raise StateIntegrityError(
                f"The rendezvous state {where} is signed, but this agent has no signing secret. "
                "Give every agent the same 'secret_file' or 'secret_env'."
            )
        mac = blob[header : header + _MAC_BYTES]
        state = blob[header + _MAC_BYTES :]
        if not hmac.compare_digest(mac, self._mac(self._secret, key, nonce, state)):
            raise StateIntegrityError(
                f"The rendezvous state {where} fails its HMAC-SHA256 check; it was written "
                "without this run's secret or altered, so it is refused."
            )
        return state

    @staticmethod
    def _mac(secret: bytes, key: bytes, nonce: bytes, state: bytes) -> bytes:
        digest = hmac.new(secret, digestmod=hashlib.sha256)
        for part in (key, nonce, state):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
        return digest.digest()
