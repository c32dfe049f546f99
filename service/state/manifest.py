"""What makes a state file a checkpoint: its manifest, the checksum it names, and the zip archive's writer.

A manifest names exactly one checksum of its state file: ``sha256`` (disk
checkpoints; every manifest written before the kinds existed has it) or
``xxh3_128`` (the in-memory snapshots of :mod:`service.state.snapshot`: about
six times faster on the same core, and a snapshot is only ever read back by
the job that wrote it). A snapshot's zip archive is also written without
torch.save's per-record crc32 (:func:`save_without_crc32`), which that checksum
already covers. Nothing in a manifest is used before pydantic has checked it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
from typing import Any, BinaryIO, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

Checksum = Literal["sha256", "xxh3_128"]
CHECKSUMS: tuple[Checksum, ...] = ("sha256", "xxh3_128")


class Manifest(BaseModel):
    """What makes a state file a checkpoint; its JSON is checked before anything is read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = 1
    step: int = Field(ge=0, lt=10**8)
    file: str
    size: int = Field(ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # exactly one checksum (CHECKSUMS) is named
    xxh3_128: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    config_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    torch: str
    service: str
    created: float
    lineage: str | None = None  # the run that wrote it; prune touches only its own run's checkpoints

    @model_validator(mode="after")
    def _one_checksum(self) -> Manifest:
        named = [kind for kind in CHECKSUMS if getattr(self, kind) is not None]
        if len(named) != 1:
            raise ValueError(f"a manifest names exactly one checksum of its state file ({' or '.join(CHECKSUMS)}); "
                             f"this one names {' and '.join(named) or 'none'}")  # fmt: skip
        return self

    @property
    def checksum(self) -> tuple[Checksum, str]:
        """The kind of checksum this manifest names, and its hex digest."""
        kind = next(kind for kind in CHECKSUMS if getattr(self, kind) is not None)
        return kind, str(getattr(self, kind))

    def to_json(self) -> bytes:
        """The manifest's JSON, naming only its own checksum: a sha256 manifest reads as one written before the
        kinds existed."""
        unused: set[str] = {kind for kind in CHECKSUMS if getattr(self, kind) is None}
        return self.model_dump_json(indent=2, exclude=unused).encode()


def new_digest(kind: Checksum) -> Any:
    """A running hash of ``kind`` (``update``, ``hexdigest``)."""
    if kind == "xxh3_128":
        import xxhash  # only a job that keeps snapshots (or reads one) needs it

        return xxhash.xxh3_128()
    return hashlib.sha256()


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it, in one pass."""

    def __init__(self, raw: BinaryIO, kind: Checksum) -> None:
        self.raw = raw
        self.digest = new_digest(kind)
        self.size = 0
        self.error: OSError | None = None  # torch's zip writer turns a failed write into a RuntimeError

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self.raw.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.digest.update(view)
        self.size += len(view)
        return len(view)


def save_without_crc32(state: Any, file: BinaryIO) -> None:
    """``torch.save(state, file)``, but with no crc32 in the zip's records: for a file whose manifest's checksum
    covers every byte (a snapshot: the crc32 was a fifth of its CPU). ``torch.load`` reads it as any other.

    Per call, not through ``torch.serialization.set_crc32_options``: torch 2.13 keeps that setting per thread, but
    earlier versions this package supports keep it for the whole process, where a disk checkpoint written by the
    async checkpointer's thread, or a script's own ``torch.save``, at the same moment would lose its crc32 too. This
    builds torch.save's own zip writer (``PyTorchFileWriter``, with ``compute_crc32=False``) and runs its ``_save``
    into it; a torch whose private serialization API differs gets a plain ``torch.save`` (its crc32 kept)."""
    serialization = torch.serialization
    writer_type = getattr(torch._C, "PyTorchFileWriter", None)
    save = getattr(serialization, "_save", None)
    alignment = getattr(serialization, "_get_storage_alignment", None)
    archive = None
    if writer_type is not None and save is not None and alignment is not None:
        try:
            archive = writer_type(file, False, alignment())
        except TypeError:  # another torch's writer: keep the crc32 below, lose nothing else
            archive = None
    if archive is None or save is None:
        torch.save(state, file)
        return
    try:
        save(state, archive, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # As torch.save's own writer does on its way out: a writer left open writes its end from its destructor,
        # later, into a file that may be detached or closed by then, and an error there ends the process (SIGABRT).
        # write_end_of_file marks it finished even when it raises.
        with contextlib.suppress(Exception):
            archive.write_end_of_file()
        raise
    archive.write_end_of_file()
    file.flush()
