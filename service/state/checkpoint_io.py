"""Checkpoint files on disk: atomic writes with a manifest, validation, safe loading, pruning.

A checkpoint is two files in ``run_dir/checkpoints``:

- ``step-NNNNNNNN.pt``: the state, written by ``torch.save`` to a temporary
  name, fsynced, then renamed;
- ``step-NNNNNNNN.json``: its manifest (step, file name, size, checksum,
  config hash, versions), written the same way, after the state.

The checksum is sha256 on disk, xxh3_128 in the in-memory snapshots; the
manifest names which (:mod:`service.state.manifest`).

A checkpoint counts only when its manifest parses and the state file has the
size and checksum it names. Anything else (a crash before the rename, a
truncated or flipped file, a missing manifest) is skipped with a warning, and
the checkpoint before it is used. Both files are opened only when they are
regular files (a symlink only to one inside the checkpoint directory), and
the state's size is matched to its manifest before a byte is read: a planted
FIFO would block the resume, a link to /dev/zero would never end. States load
with ``weights_only=True``: a file that holds any other pickled object is
refused and nothing in it runs.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from pydantic import ValidationError

from service.state.best import read_best
from service.state.files import fsync_dir, open_regular, read_small, write_synced
from service.state.manifest import Checksum, HashingWriter, Manifest, new_digest, save_without_crc32
from service.state.names import manifest_name, state_name

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.(pt|json)$")
_MAX_MANIFEST_BYTES = 64 * 1024
_WRITE_BUFFER = 1 << 20  # bytes gathered before a write reaches the file (and its hash)
REQUIRED_KEYS = ("format", "loop", "rng", "config")  # and each kept object it names (``kept``)
TASK_KEPT_KEYS = ("model", "optimizer", "scheduler")  # what a checkpoint written before ``kept`` always held
TASK_KEPT = (*TASK_KEPT_KEYS, "scaler")  # a task job's kept objects (a missing ``scaler`` entry reads as None)


def kept_names(state: Mapping[str, Any]) -> list[str]:
    """The names of the shared objects a checkpoint holds (a checkpoint without ``kept``: a task job's four)."""
    names = state.get("kept")
    if names is None:
        return list(TASK_KEPT)
    return [str(name) for name in names]


def module_names(state: Mapping[str, Any]) -> list[str]:
    """The kept objects of a checkpoint that are modules' weights: a non-empty mapping of names to tensors."""

    def weights(value: Any) -> bool:
        return (
            isinstance(value, dict)
            and bool(value)
            and all(isinstance(key, str) and isinstance(tensor, torch.Tensor) for key, tensor in value.items())
        )

    return [name for name in kept_names(state) if weights(state.get(name))]


def missing_keys(state: dict[str, Any]) -> list[str]:
    """The entries a ddp-service checkpoint of this format must have and ``state`` lacks: the loop's own, and each
    kept object its ``kept`` list names (one without that list: a task job's model, optimizer and scheduler)."""
    kept = state.get("kept", TASK_KEPT_KEYS)
    names = [*REQUIRED_KEYS, *(kept if isinstance(kept, (list, tuple)) else ["kept (a list of names)"])]
    return [key for key in names if not isinstance(key, str) or key not in state]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or must not be loaded; the message names the file and the fix."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, read-only, gone); the previous checkpoint is untouched."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds pickled objects other than tensors and plain containers; it was not executed."""


class WeightsError(ValueError):
    """A weights file cannot be read or does not fit; the message names the file and the fix."""

    exit_code = 2


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists: where the free space of a directory yet to be made is read."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(directory: Path) -> str:
    """'N MiB free of M MiB' for the file system that holds ``directory`` (or its nearest existing parent)."""
    probe = nearest_existing(directory)
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"


def write_checkpoint(directory: Path, step: int, state: dict[str, Any], config_hash: str,
                     lineage: str | None = None, checksum: Checksum = "sha256",
                     zip_crc32: bool = True, create: bool = True) -> Manifest:  # fmt: skip
    """Write ``state`` as the checkpoint of ``step``, replacing one of that step atomically.

    Both files are written under temporary names and fsynced before either is
    renamed, so a full disk or a crash leaves the previous checkpoints valid
    and never a newest one that looks complete but is not. ``checksum``: the
    kind the manifest names; ``zip_crc32=False`` leaves torch.save's own crc32
    out (:func:`save_without_crc32`); ``create=False``: ``directory`` must exist
    (a snapshot area that vanished is not made again, with another mode and no
    marker). Whatever fails, every file and writer opened here is closed.
    """
    from service.version import __version__

    final, manifest_path = directory / state_name(step), directory / manifest_name(step)
    tmp_state = directory / f".{final.name}.{os.getpid()}.tmp"
    tmp_manifest = directory / f".{manifest_path.name}.{os.getpid()}.tmp"
    serialize = torch.save if zip_crc32 else save_without_crc32
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)

        def save(file: BinaryIO) -> HashingWriter:
            writer = HashingWriter(file, checksum)
            # torch's zip writer makes a write per record header, name and alignment pad (about 350 for a model
            # of 60 tensors): the buffer gathers the small ones, and a tensor's bytes pass through it whole.
            buffered = io.BufferedWriter(writer, buffer_size=_WRITE_BUFFER)
            try:
                serialize(state, cast(BinaryIO, buffered))
                buffered.flush()
            except RuntimeError:
                if writer.error is not None:  # the disk, not the state: report the OSError
                    raise writer.error from None
                raise
            finally:
                with contextlib.suppress(OSError, ValueError):  # a failed flush: the error above is the one told
                    buffered.close()  # closes the hashing writer only: the file stays open for write_synced's fsync
            return writer

        writer = write_synced(tmp_state, save)
        manifest = Manifest.model_validate({
            "step": step, "file": final.name, "size": writer.size, checksum: writer.digest.hexdigest(),
            "config_hash": config_hash, "torch": str(torch.__version__), "service": __version__,
            "created": time.time(), "lineage": lineage,
        })  # fmt: skip
        write_synced(tmp_manifest, lambda file: file.write(manifest.to_json()))
        os.replace(tmp_state, final)
        os.replace(tmp_manifest, manifest_path)
        fsync_dir(directory)
    except OSError as exc:
        for leftover in (tmp_state, tmp_manifest):
            leftover.unlink(missing_ok=True)
        raise CheckpointWriteError(describe_write_error(exc, final)) from exc
    except BaseException:
        for leftover in (tmp_state, tmp_manifest):
            leftover.unlink(missing_ok=True)
        raise
    return manifest


def describe_write_error(exc: OSError, path: Path) -> str:
    reason = exc.strerror or str(exc)
    code = errno.errorcode.get(exc.errno or 0, "")
    hint = {
        "ENOSPC": "free space there or point run_dir at a larger volume",
        "EDQUOT": "raise the quota or point run_dir at another volume",
        "EROFS": "run_dir is on a read-only file system; point it at a writable one",
        "EACCES": "make run_dir writable for this user, or point it elsewhere",
        "EPERM": "make run_dir writable for this user, or point it elsewhere",
    }.get(code, "check the storage behind run_dir")
    return (
        f"Could not write checkpoint {path}: {reason}{f' ({code})' if code else ''}; "
        f"{free_space(path.parent)} there. The previous checkpoints are untouched. Fix: {hint}. "
        "checkpoint.on_error=continue keeps training when a save fails."
    )


def _step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def candidate_steps(directory: Path) -> list[int]:
    """Steps that have a state file or a manifest, newest first."""
    if not directory.is_dir():
        return []
    steps = {step for path in directory.iterdir() if (step := _step_of(path)) is not None}
    return sorted(steps, reverse=True)


def checkpoint_dir(run_dir: Path) -> Path:
    """``run_dir/checkpoints``, or ``run_dir`` itself when it is a checkpoint directory."""
    inner = run_dir / "checkpoints"
    if not inner.is_dir() and candidate_steps(run_dir):
        return run_dir
    return inner


def saved_steps(directory: Path) -> list[int]:
    """Steps that have a manifest (a save that finished, checked or not), newest first."""
    return [step for step in candidate_steps(directory) if (directory / manifest_name(step)).exists()]


def pick_step(run_dir: Path, which: str) -> tuple[Path, int]:
    """The checkpoint directory and step that ``which`` (``latest``, ``best`` or a step number) names."""
    directory = checkpoint_dir(run_dir)
    steps = saved_steps(directory)
    if not steps:
        raise WeightsError(f"{run_dir} holds no checkpoint (no {directory}/step-NNNNNNNN.json); point it at "
                           "the run_dir of a run that saved one (checkpoint.every_steps, or its end)")  # fmt: skip
    if which == "latest":
        return directory, steps[0]
    if which == "best":
        try:
            record = read_best(directory)
        except ValueError as exc:
            raise WeightsError(f"{exc}; export --step latest or a step number instead") from None
        if record is None:
            raise WeightsError(f"{run_dir} has no best checkpoint ({directory}/best.json): its run did not set "
                               "checkpoint.best, or stopped before an evaluation. Train with checkpoint.best: "
                               "{metric: NAME, mode: min|max}, or export --step latest or a step number.")  # fmt: skip
        return directory, record.step
    step = int(which) if which.isdigit() else None
    if step is None or step not in steps:
        listed = ", ".join(str(s) for s in sorted(steps))
        raise WeightsError(f"{run_dir} has no checkpoint of step {which}; it has steps {listed}. Pass one of "
                           "those, latest or best to --step.")  # fmt: skip
    return directory, step


def read_manifest(directory: Path, step: int) -> Manifest:
    """The manifest of ``step``; ``ValueError`` with the reason when it is missing or malformed."""
    path = directory / manifest_name(step)
    try:
        raw = read_small(directory, path.name, _MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ValueError("it has no manifest (a save that did not finish)") from None
    if raw is None:
        raise ValueError(f"its manifest {path.name} is larger than {_MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = Manifest.model_validate(json.loads(raw))
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, error['loc'])) or 'manifest'}: {error['msg']}"
                        for error in exc.errors()[:3])  # fmt: skip
        raise ValueError(f"its manifest {path.name} is not valid ({why[:500]})") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"its manifest {path.name} is not valid ({str(exc).splitlines()[0]})") from None
    if manifest.step != step or manifest.file != state_name(step):
        raise ValueError(f"its manifest {path.name} names step {manifest.step}, file {manifest.file!r}")
    return manifest


def read_verified(directory: Path, step: int) -> tuple[Manifest, bytes]:
    """The manifest and state bytes of ``step`` after checking its size and the checksum its manifest names
    (sha256 or xxh3_128); ``ValueError`` if they fail."""
    manifest = read_manifest(directory, step)
    try:
        file, size = open_regular(directory, manifest.file)
    except FileNotFoundError:
        raise ValueError(f"its state file {manifest.file} is missing") from None
    payload = b""
    with file:
        if size == manifest.size:  # else nothing is read: a sparse 1 TB file never reaches memory
            payload = file.read(size + 1)  # one byte more: a file that grew since the fstat is caught too
            size = len(payload)
    if size != manifest.size:
        why = "truncated?" if size < manifest.size else "written to since, or replaced?"
        raise ValueError(f"{manifest.file} has {size} bytes, its manifest says {manifest.size} ({why})")
    kind, expected = manifest.checksum
    digest = new_digest(kind)
    digest.update(payload)
    if digest.hexdigest() != expected:
        raise ValueError(f"{manifest.file} does not match the {kind} in its manifest (corrupted)")
    return manifest, payload


_RESUME_FIX = ("This service checks every kept state at its first save, so its own checkpoints load; one written "
               "by an older version may not. Resume it with the version that wrote it, or start afresh with --set "
               "checkpoint.resume=never (the file is left as it is).")  # fmt: skip


def load_tensors(payload: bytes | str, source: str, fix: str = _RESUME_FIX, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of ``payload`` (bytes, or a file's path; ``mmap``: its storages mapped, not
    read, a torch zip only): tensors and plain containers only; anything else is refused with
    :class:`UnsafeCheckpointError` (ending in ``fix``) before any of it runs."""
    try:
        data = io.BytesIO(payload) if isinstance(payload, bytes) else payload
        return torch.load(data, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"Refused to load {source}: it holds pickled objects other than tensors and plain containers "
            f"({str(exc).splitlines()[0][:200]}). Nothing in it was executed. {fix}"
        ) from None
    except (RuntimeError, ValueError, EOFError) as exc:
        raise ValueError(f"{source} is not a readable torch checkpoint ({str(exc).splitlines()[0][:200]})") from exc


def load_state(payload: bytes, source: str) -> dict[str, Any]:
    """Unpickle a state with ``weights_only=True``; refuse, without running it, anything else."""
    if not payload.startswith(b"PK\x03\x04"):
        raise ValueError(f"{source} is not a torch checkpoint (torch.save writes a zip archive)")
    state = load_tensors(payload, source)
    if not isinstance(state, dict) or state.get("format") != FORMAT or missing_keys(state):
        raise ValueError(f"{source} is not a ddp-service checkpoint of format {FORMAT}")
    return state


def scan(directory: Path, lineages: Collection[str | None] | None = None,
         above: int = -1) -> Iterator[tuple[Manifest, bytes]]:  # fmt: skip
    """Valid checkpoints newer than step ``above``, newest first; each invalid one is skipped with a warning.

    With ``lineages``, a checkpoint whose manifest names another lineage is
    passed over before its state file is read.
    """
    for step in candidate_steps(directory):
        if step <= above:
            return
        try:
            if lineages is not None and read_manifest(directory, step).lineage not in lineages:
                continue
            yield read_verified(directory, step)
        except ValueError as exc:
            log.warning("skipping checkpoint %s: %s", directory / state_name(step), exc)


def prune(directory: Path, keep: int, newest: int, lineages: Collection[str | None] | None = None,
          protect: Collection[int] = ()) -> None:  # fmt: skip
    """Keep the ``keep`` newest checkpoints up to ``newest`` (just written and complete); drop older ones.

    A manifest goes before its state file, so nothing half-deleted looks valid.
    Leftover temporary files and state files without a manifest below the
    kept ones go too. With ``lineages``, checkpoints whose manifest names
    another lineage (another run wrote them into this directory) are neither
    counted nor deleted, nor are the steps in ``protect`` (the best checkpoint).
    """

    def ours(step: int) -> bool:
        if lineages is None or not (directory / manifest_name(step)).exists():
            return True  # no manifest: a save that never finished, nobody's checkpoint
        try:
            return read_manifest(directory, step).lineage in lineages
        except ValueError:
            return False  # a manifest that does not parse is left for a human to look at

    steps = [step for step in candidate_steps(directory) if step <= newest and ours(step)]
    kept = [step for step in steps if (directory / manifest_name(step)).exists()][:keep]
    if newest not in kept or len(kept) < keep:
        return
    for step in steps:
        if step < kept[-1] and step not in protect:
            (directory / manifest_name(step)).unlink(missing_ok=True)
            (directory / state_name(step)).unlink(missing_ok=True)
    for leftover in directory.glob(".step-*.tmp"):
        if f".{os.getpid()}." not in leftover.name:
            leftover.unlink(missing_ok=True)
