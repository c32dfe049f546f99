"""The stored form of the rendezvous state: an envelope, optionally HMAC-signed.

torch's handler unpickles whatever bytes the backend returns, so whoever can
write the rendezvous key can run code in every agent. With a shared secret the
backend signs each state and refuses a state whose signature fails, before the
bytes reach ``pickle``. A random nonce in every envelope also lets the backend
recognise its own write after an uncertain (timed-out) transaction.
"""

from __future__ import annotations

import hashlib
import hmac
import os

MAGIC = b"ddp-etcd3-rdzv\x01"
_SIGNED = b"S"
_UNSIGNED = b"U"
_NONCE_BYTES = 16
_MAC_BYTES = hashlib.sha256().digest_size


class StateIntegrityError(ValueError):
    """The stored bytes are not a state this backend may hand to torch."""


class StateCodec:
    """Wraps and unwraps state bytes; signs them when a secret is configured."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    @property
    def signs(self) -> bool:
        """Whether this codec signs and verifies."""
        return self._secret is not None

    def encode(self, state: bytes, key: bytes) -> bytes:
        """Envelope ``state`` for ``key``; the key is signed too, so states cannot move between runs."""
        nonce = os.urandom(_NONCE_BYTES)
        if self._secret is None:
            return MAGIC + _UNSIGNED + nonce + state
        return MAGIC + _SIGNED + nonce + self._mac(key, nonce, state) + state

    def decode(self, blob: bytes, key: bytes) -> bytes:
        """Return the state inside ``blob`` or raise ``StateIntegrityError``."""
        header = len(MAGIC) + 1 + _NONCE_BYTES
        if len(blob) < header or not blob.startswith(MAGIC):
            raise StateIntegrityError(
                "The rendezvous state in etcd is corrupt: it lacks the etcd3 backend's header."
            )
        kind = blob[len(MAGIC):len(MAGIC) + 1]
        nonce = blob[len(MAGIC) + 1:header]
        if kind == _UNSIGNED:
            if self._secret is not None:
                raise StateIntegrityError(
                    "The rendezvous state in etcd is not signed, but this agent has a signing "
                    "secret; refusing it. Give every agent the same secret."
                )
            return blob[header:]
        if kind != _SIGNED or len(blob) < header + _MAC_BYTES:
            raise StateIntegrityError("The rendezvous state in etcd is corrupt: its header is unknown.")
        if self._secret is None:
            raise StateIntegrityError(
                "The rendezvous state in etcd is signed, but this agent has no signing secret. "
                "Give every agent the same 'secret_file' or 'secret_env'."
            )
        mac = blob[header:header + _MAC_BYTES]
        state = blob[header + _MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, nonce, state)):
            raise StateIntegrityError(
                "The rendezvous state in etcd fails its HMAC-SHA256 check; it was written "
                "without this run's secret or altered, so it is refused."
            )
        return state

    def _mac(self, key: bytes, nonce: bytes, state: bytes) -> bytes:
        assert self._secret is not None
        digest = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (key, nonce, state):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
        return digest.digest()
