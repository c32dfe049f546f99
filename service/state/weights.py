"""Model weights alone: read from a checkpoint, a state dict file or safetensors; exported; loaded into a model.

``ddp-service export`` writes a checkpoint's ``model`` entry for inference
(:func:`export_weights`); ``init_from`` starts a fresh run from a weights file
(:func:`init_model`). Both read through the checks a resume uses
(:mod:`service.state.checkpoint_io`): a service checkpoint only after its
manifest's size and sha256 match, and every torch file with
``weights_only=True``, so a pickle that holds code is refused before it runs.
Keys lose the ``module.`` (DDP, DataParallel) and ``_orig_mod.``
(``torch.compile``) prefixes.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from service.state.checkpoint_io import (
    FORMAT,
    UnsafeCheckpointError,
    WeightsError,
    _step_of,
    load_state,
    load_tensors,
    manifest_name,
    missing_keys,
    module_names,
    pick_step,
    read_verified,
    state_name,
)
from service.state.files import kind_of, open_regular

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "pt")
_SHOWN = 5  # keys named in an error, of each kind


def strip_prefixes(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Keys without the wrappers' prefixes: leading ``module.``, and ``_orig_mod.`` wherever compile put it."""
    out: dict[str, Any] = {}
    for key, value in weights.items():
        parts = [part for part in key.split(".") if part != "_orig_mod"]
        while len(parts) > 1 and parts[0] == "module":
            parts.pop(0)
        name = ".".join(parts)
        if name in out:
            raise WeightsError(f"two keys of the weights both name {name!r} once their module./_orig_mod. prefixes "
                               f"are stripped (one is {key!r}); save the state dict of one model")  # fmt: skip
        out[name] = value
    return out


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return f"{len(keys)} ({shown}{', ...' if len(keys) > _SHOWN else ''})"


# --- where a checkpoint is -------------------------------------------------------------------------------------


def pick_module(state: dict[str, Any], module: str | None, source: str) -> str:
    """The kept module to read: ``module``, or the checkpoint's one module (a task job's ``model``); a checkpoint of
    a script that kept several names them."""
    names = module_names(state)
    if module is not None:
        if module not in names:
            raise WeightsError(f"{source} has no kept module {module!r}; its modules are {', '.join(names) or 'none'}. "
                               "Pass one of them to --module.")  # fmt: skip
        return module
    if len(names) == 1:
        return names[0]
    raise WeightsError(f"{source} keeps {len(names)} modules ({', '.join(names) or 'none'}); say which with "
                       f"--module NAME, e.g. --module {names[0] if names else 'model'}.")  # fmt: skip


def checkpoint_weights(directory: Path, step: int, module: str | None = None) -> dict[str, Tensor]:
    """A kept module's weights (``module``, or the only one) from a checkpoint, read only after its manifest's size
    and sha256 match."""
    source = directory / state_name(step)
    try:
        _, payload = read_verified(directory, step)
        state = load_state(payload, str(source))
        return _tensors(state[pick_module(state, module, str(source))], str(source))
    except UnsafeCheckpointError as exc:
        raise WeightsError(str(exc)) from None
    except ValueError as exc:
        if isinstance(exc, WeightsError):
            raise
        raise WeightsError(f"Checkpoint {source} cannot be used: {exc}. Nothing was read from its state; pick "
                           "another step, or re-run the training that wrote it.") from None  # fmt: skip


# --- reading a weights file --------------------------------------------------------------------------------------

_PICKLE_FIX = ("It holds code or objects (a whole model saved with torch.save(model), or a training state with "
               "custom classes), not a state dict. Convert it once, in code you trust: "
               "torch.save(model.state_dict(), 'weights.pt') (or safetensors.torch.save_file), and point "
               "init_from at that file.")  # fmt: skip


_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"  # torch.save: a zip archive, or the legacy format's pickle
_HEAD = 9  # enough to tell the formats apart: safetensors is an 8-byte header length, then its JSON ("{")


def read_weights(path: Path) -> dict[str, Tensor]:
    """Model weights from a state dict ``.pt``/``.pth``, a ``.safetensors`` file, a service checkpoint
    (``step-NNNNNNNN.pt`` next to its manifest; its checks first) or a run dir (its newest checkpoint).

    A plain file is told by its first bytes, and only then read, by the reader of its format, which maps or
    reads the tensors it holds, never the whole file at once: a large file that is no weights file is refused
    before anything else of it is read, and memory is bounded by the tensors loaded.
    """
    if path.is_dir():
        return checkpoint_weights(*pick_step(path, "latest"))
    step = _step_of(path)
    if step is not None and path.suffix == ".pt" and (path.parent / manifest_name(step)).exists():
        return checkpoint_weights(path.parent, step)
    resolved = path.resolve()
    try:
        file, size = open_regular(resolved.parent, resolved.name)
    except FileNotFoundError:
        raise WeightsError(f"{path} does not exist on this node; put the weights file there (or on storage "
                           "every node sees) or fix the path") from None  # fmt: skip
    except (ValueError, OSError) as exc:
        raise WeightsError(f"cannot read {path}: {exc}") from None
    with file:
        head = file.read(_HEAD)
        # The descriptor checked above, reopened by its /proc name: a file swapped in at the path since is not read.
        opened = f"/proc/self/fd/{file.fileno()}" if Path("/proc/self/fd").is_dir() else str(resolved)
        if head.startswith((_ZIP, _PICKLE)):
            try:
                loaded = load_tensors(opened, str(path), _PICKLE_FIX, mmap=head.startswith(_ZIP))
            except UnsafeCheckpointError as exc:
                raise WeightsError(str(exc)) from None
            except ValueError as exc:
                raise WeightsError(f"{exc}; save the weights with torch.save(model.state_dict(), PATH)") from None
            return _state_dict_of(loaded, path)
        if len(head) == _HEAD and head[8:9] == b"{":
            return _safetensors(opened, path, int.from_bytes(head[:8], "little"), size)
    raise WeightsError(f"{path} is neither a torch file nor a safetensors file (its first bytes are {head[:8]!r}); "
                       "give init_from a state dict saved with torch.save(model.state_dict(), PATH), a .safetensors "
                       "file or a service checkpoint")  # fmt: skip


def _safetensors(opened: str, path: Path, header: int, size: int) -> dict[str, Tensor]:
    """The tensors of a safetensors file, each read from the mapped file on its own."""
    from safetensors import SafetensorError, safe_open

    fix = "write it with safetensors.torch.save_file(model.state_dict(), PATH)"
    if header > size - 8:
        raise WeightsError(f"{path} is not a readable safetensors file (its header length {header} is past the end "
                           f"of its {size} bytes); {fix}")  # fmt: skip
    try:
        with safe_open(opened, framework="pt", device="cpu") as tensors:
            return {name: tensors.get_tensor(name) for name in tensors.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"{path} is not a readable safetensors file ({exc}); {fix}") from None


def _state_dict_of(loaded: Any, path: Path) -> dict[str, Tensor]:
    if isinstance(loaded, dict) and loaded.get("format") == FORMAT and not missing_keys(loaded):
        raise WeightsError(f"{path} is a ddp-service checkpoint without its manifest, so its checksum cannot be "
                           f"checked. Keep it as step-NNNNNNNN.pt next to its step-NNNNNNNN.json, or write its "
                           "weights with `ddp-service export RUN_DIR OUT` and use that file.")  # fmt: skip
    if isinstance(loaded, dict) and loaded and not any(isinstance(value, Tensor) for value in loaded.values()):
        for wrapper in ("state_dict", "model"):  # {"state_dict": ...} (Lightning), {"model": ...}
            if isinstance(loaded.get(wrapper), dict):
                log.info("%s: reading the state dict under its %r key", path, wrapper)
                return _tensors(loaded[wrapper], str(path))
    return _tensors(loaded, str(path))


def _tensors(state: Any, source: str) -> dict[str, Tensor]:
    if not isinstance(state, dict):
        raise WeightsError(f"{source} holds a {type(state).__name__}, not a state dict; save "
                           "model.state_dict() (a mapping of names to tensors)")  # fmt: skip
    bad = [str(key) for key, value in state.items() if not isinstance(key, str) or not isinstance(value, Tensor)]
    if bad:
        raise WeightsError(f"{source} is not a state dict of tensors: {_names(bad)} are not a name and a tensor; "
                           "save model.state_dict()")  # fmt: skip
    return state


# --- into a model ---------------------------------------------------------------------------------------------------


def load_weights(model: nn.Module, weights: Mapping[str, Tensor], source: str, strict: bool = True) -> int:
    """Copy ``weights`` into ``model``, naming what does not fit; returns how many tensors were loaded."""
    weights = strip_prefixes(weights)
    expected = model.state_dict()
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    shapes = [f"{key} {tuple(value.shape)} in the file, {tuple(expected[key].shape)} in the model"
              for key, value in weights.items() if key in expected and value.shape != expected[key].shape]  # fmt: skip
    if shapes:
        raise WeightsError(f"init_from {source}: {len(shapes)} tensors differ in shape ({'; '.join(shapes[:_SHOWN])}"
                           f"{'; ...' if len(shapes) > _SHOWN else ''}). Use weights of this task's model with the "
                           "same task_options.")  # fmt: skip
    parts = ([f"{_names(missing)} keys of the model are not in the file"] if missing else []) + (
        [f"{_names(unexpected)} keys of the file are not in the model"] if unexpected else []
    )
    if strict and parts:
        raise WeightsError(f"init_from {source} does not fit the model: {'; '.join(parts)}. Use weights of this "
                           "task's model, or set init_from: {path: ..., strict: false} to load the keys that match "
                           "and keep the task's own values for the rest.")  # fmt: skip
    matched = {key: value for key, value in weights.items() if key in expected}
    if not matched:
        raise WeightsError(f"init_from {source}: none of its {len(weights)} keys is a key of the model "
                           f"({'; '.join(parts)}); it holds another model's weights")  # fmt: skip
    model.load_state_dict(matched, strict=False)
    if parts:
        log.warning("init_from %s (strict: false): %s", source, "; ".join(parts))
    return len(matched)


def init_model(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """``init_from``: load a weights file into a freshly built model, before it is wrapped."""
    try:
        weights = read_weights(Path(path))
    except WeightsError as exc:
        raise WeightsError(f"init_from: {exc}") from None
    loaded = load_weights(model, weights, str(path), strict)
    log.info("init_from: loaded %d tensors from %s", loaded, path)


# --- out, for inference ---------------------------------------------------------------------------------------------


def check_out(out: Path) -> None:
    """``WeightsError`` unless ``out`` is absent or a regular file: the export renames a new file over it, which
    would replace a device (``/dev/null``), a FIFO or a symlink itself, and the node would be gone."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISLNK(mode):
        what = f"a symbolic link to {os.readlink(out)}"
        fix = f"name the file itself (export writes {out.resolve()} if you pass that path) or remove the link"
    elif stat.S_ISDIR(mode):
        what, fix = "a directory", f"name the file to write, e.g. {out / 'model.safetensors'}"
    else:
        what, fix = kind_of(mode), "name a new file, or a regular file to overwrite, e.g. model.safetensors"
    raise WeightsError(f"{out} is {what}, not a regular file. export writes a new file and renames it over OUT, which "
                       f"would replace {out} itself, so it left it alone and wrote nothing: {fix}.")  # fmt: skip


def export_weights(weights: Mapping[str, Tensor], out: Path, fmt: str, metadata: Mapping[str, str]) -> int:
    """Write ``weights`` to ``out`` atomically; returns how many tied tensors were written as copies.

    safetensors refuses tensors that share memory (a GPT's embedding and its
    output head): each alias after the first is written as a copy, so every key
    is present and ``load_state_dict(load_file(out), strict=True)`` works (the
    model ties them again itself). ``pt`` keeps the sharing.
    """
    if fmt not in FORMATS:
        raise WeightsError(f"--format {fmt} is not one of {', '.join(FORMATS)}")
    check_out(out)
    weights = strip_prefixes(weights)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    copies = 0
    try:
        if fmt == "pt":
            torch.save(weights, tmp)
        else:
            from safetensors.torch import save_file

            seen: set[int] = set()
            tensors: dict[str, Tensor] = {}
            for key, value in weights.items():
                pointer = value.untyped_storage().data_ptr()
                alias = value.numel() > 0 and pointer in seen
                seen.add(pointer)
                copies += alias
                tensors[key] = value.detach().clone() if alias else value.detach().contiguous()
            save_file(tensors, str(tmp), metadata={"format": "pt", **metadata})
        check_out(out)  # again, just before the rename: what stands at OUT now is what is replaced
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return copies
