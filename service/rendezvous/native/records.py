"""What the etcd-native rendezvous keeps in etcd: the key layout and its JSON records.

Under ``<key_prefix>/<run_id>/rdzv/``:

* ``rounds/<r>/<node>``: one :class:`NodeRecord` per node that joins round ``r``,
  on that node's own lease, so it vanishes when the node dies;
* ``sealed/<r>``: the :class:`SealRecord` that fixes round ``r``: its size and
  which joiners are in (``cutoff``), on the run's lease; written once, by one transaction;
* ``ranks/<r>/<sealer>/<node>``: one :class:`RankRecord` per member of round ``r``,
  written by the node that sealed it (with the seal, in chunks), on the run's
  lease; each member reads its own, so a seal costs every node O(1) bytes;
* ``closed``: a :class:`ClosedRecord` once the run is over, on the run's lease.

Round numbers are zero-padded, so keys sort by round. Every value is JSON
validated by pydantic; nothing read from etcd is unpickled. A value that does
not validate is refused with :class:`RecordError`, naming the key.

With a signing secret (``secret_file``/``secret_env``), every value is written
as ``ddp-hmac1:<HMAC-SHA256 over key and body>:<JSON>``. A value whose
signature is missing or wrong (:meth:`Layout.forgery`) was not written by an
agent of the run: the handler ignores it, as if the key were absent, and
deletes it, so a writer without the secret can neither plant members, seals or
``closed`` nor stop the run with one put. Without a secret, a signed value is
refused (the agents disagree about the secret).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

_ROUND_WIDTH = 12
_SIGNED = b"ddp-hmac1:"
M = TypeVar("M", bound="BaseModel")
NODE_ID = re.compile(r"^[A-Za-z0-9_.:\[\]-]{1,200}$")


class RecordError(RendezvousStateError):
    """A rendezvous key in etcd holds something this backend did not write."""


class NodeRecord(BaseModel):
    """A node's entry in one round: who it is and where its workers' rank 0 would listen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str = Field(pattern=NODE_ID.pattern)
    addr: str = Field(min_length=1, max_length=255)
    pid: int = Field(ge=0)
    round: int = Field(ge=0)
    member_of: int = Field(default=-1, ge=-1)  # the round this node was a member of when it joined (-1: none)


class SealRecord(BaseModel):
    """The fixed outcome of a round: ``world`` members, the round's keys created at or before ``cutoff``.

    It names no member: each reads its rank from its own key ``ranks/<round>/<sealed_by>/<node>``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    round: int = Field(ge=0)
    world: int = Field(ge=1)
    cutoff: int = Field(ge=1)  # create_revision of the last member by join order
    sealed_by: str = Field(pattern=NODE_ID.pattern)  # names the rank keys' folder: no "/" in it
    sealed_at: float = 0.0
    # The revision the sealer decided at: every key of the round then created by the cutoff is a member, so a key
    # of the round deleted after it is a member gone (the seal's compare sees new and changed keys, not deleted ones).
    decided_at: int = Field(default=0, ge=0)


class RankRecord(BaseModel):
    """One member's place in a sealed round, written by its sealer: rank (by node id), the world's size, and the
    seal's cutoff."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    round: int = Field(ge=0)
    rank: int = Field(ge=0)
    world: int = Field(ge=1)
    cutoff: int = Field(ge=1)  # the seal's: a rank left from a failed try of the same sealer does not match
    sealed_by: str = Field(pattern=NODE_ID.pattern)


class ClosedRecord(BaseModel):
    """The run is over: written by the node that closed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    closed_by: str
    closed_at: float = 0.0


def parse(model: type[M], raw: bytes, key: bytes) -> M:
    """``raw`` validated as ``model``, or :class:`RecordError` naming the key."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RecordError(
            f"The rendezvous key {key.decode(errors='replace')} in etcd holds a value this backend did not "
            f"write ({exc.error_count()} problem(s), first: {exc.errors()[0]['msg']}). Something else writes under "
            "the run's prefix; restrict it with etcd's authentication, or use another --rdzv-id."
        ) from None


@dataclass(frozen=True)
class Layout:
    """Key names of one run's native rendezvous, and how its values are written and read."""

    base: bytes  # <key_prefix>/<run_id>/rdzv/
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def of(cls, key_prefix: str, run_id: str, secret: bytes | None = None) -> Layout:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        return cls(f"{key_prefix.rstrip('/')}/{run_id}/rdzv/".encode(), secret)

    def encode(self, key: bytes, record: BaseModel) -> bytes:
        """The value to store under ``key``: JSON, signed when there is a secret."""
        body = record.model_dump_json().encode()
        if self.secret is None:
            return body
        return _SIGNED + _mac(self.secret, key, body).encode() + b":" + body

    def forgery(self, key: bytes, raw: bytes) -> str | None:
        """On a signed run, why ``raw`` under ``key`` cannot be from one of its agents; else ``None``.

        ``None`` on an unsigned run too: there every value is read, and :meth:`decode` refuses bad ones.
        """
        if self.secret is None:
            return None
        if not raw.startswith(_SIGNED):
            return "it is unsigned"
        mac, sep, body = raw[len(_SIGNED) :].partition(b":")
        if not sep or not hmac.compare_digest(mac, _mac(self.secret, key, body).encode()):
            return "its signature does not match this run's secret"
        return None

    def decode(self, model: type[M], raw: bytes, key: bytes) -> M:
        """The record under ``key``; :class:`RecordError` if unsigned, badly signed, or not valid.

        Cached: a node re-reads every key of its round each time its copy changes, and records are frozen.
        """
        return _decode_cached(self, model, raw, key)

    def decode_uncached(self, model: type[M], raw: bytes, key: bytes) -> M:
        """:meth:`decode` without the cache."""
        name = key.decode(errors="replace")
        if raw.startswith(_SIGNED):
            if self.secret is None:
                raise RecordError(
                    f"The rendezvous key {name} holds a signed value, but this agent has no signing secret; "
                    "give every agent the same 'secret_file' or 'secret_env'."
                )
            mac, sep, body = raw[len(_SIGNED) :].partition(b":")
            if not sep or not hmac.compare_digest(mac, _mac(self.secret, key, body).encode()):
                raise RecordError(
                    f"The rendezvous key {name} holds a value whose signature does not match this agent's "
                    "secret: it was forged or written with another secret. Nothing from it was used."
                )
            raw = body
        elif self.secret is not None:
            raise RecordError(
                f"The rendezvous key {name} holds an unsigned value, but this run is signed; someone without "
                "the secret wrote it. Nothing from it was used."
            )
        return parse(model, raw, key)

    @property
    def rounds(self) -> bytes:
        return self.base + b"rounds/"

    @property
    def seals(self) -> bytes:
        return self.base + b"sealed/"

    @property
    def closed(self) -> bytes:
        return self.base + b"closed"

    @property
    def ranks(self) -> bytes:
        return self.base + b"ranks/"

    @property
    def seats(self) -> bytes:
        return self.base + b"seats/"

    def seats_of_round(self, round_no: int) -> bytes:
        """The prefix of round ``round_no``'s sealer seats (``rounds.SEALERS`` keys, one per sealer)."""
        return self.seats + f"{round_no:0{_ROUND_WIDTH}d}/".encode()

    def seat_key(self, round_no: int, seat: int) -> bytes:
        return self.seats_of_round(round_no) + str(seat).encode()

    def ranks_of_round(self, round_no: int) -> bytes:
        """The prefix of every rank key of round ``round_no`` (whoever sealed it)."""
        return self.ranks + f"{round_no:0{_ROUND_WIDTH}d}/".encode()

    def ranks_prefix(self, round_no: int, sealer: str) -> bytes:
        """The prefix of the rank keys that ``sealer`` wrote for round ``round_no``."""
        return self.ranks_of_round(round_no) + sealer.encode() + b"/"

    def rank_key(self, round_no: int, sealer: str, node: str) -> bytes:
        return self.ranks_prefix(round_no, sealer) + node.encode()

    def parse_rank_key(self, key: bytes) -> tuple[int, str, str] | None:
        """(round, sealer, node) of a rank key, else ``None``."""
        if not key.startswith(self.ranks):
            return None
        parts = key[len(self.ranks) :].split(b"/")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1] or not parts[2]:
            return None
        return int(parts[0]), parts[1].decode(errors="replace"), parts[2].decode(errors="replace")

    def round_prefix(self, round_no: int) -> bytes:
        return self.rounds + f"{round_no:0{_ROUND_WIDTH}d}/".encode()

    def node_key(self, round_no: int, node: str) -> bytes:
        return self.round_prefix(round_no) + node.encode()

    def seal_key(self, round_no: int) -> bytes:
        return self.seals + f"{round_no:0{_ROUND_WIDTH}d}".encode()

    def parse_node_key(self, key: bytes) -> tuple[int, str] | None:
        """(round, node) of a node key, else ``None``."""
        if not key.startswith(self.rounds):
            return None
        head, sep, node = key[len(self.rounds) :].partition(b"/")
        if not sep or not head.isdigit() or not node:
            return None
        return int(head), node.decode(errors="replace")

    def parse_seal_key(self, key: bytes) -> int | None:
        """The round of a seal key, else ``None``."""
        if not key.startswith(self.seals):
            return None
        tail = key[len(self.seals) :]
        return int(tail) if tail.isdigit() else None


def _mac(secret: bytes, key: bytes, body: bytes) -> str:
    """HMAC-SHA256 over the key and the body, so a value cannot move to another key or run."""
    return hmac.new(secret, key + b"\0" + body, hashlib.sha256).hexdigest()


@functools.lru_cache(maxsize=8192)
def _decode_cached(layout: Layout, model: type[M], raw: bytes, key: bytes) -> M:
    return layout.decode_uncached(model, raw, key)
