"""What a job keeps: named objects with ``state_dict``/``load_state_dict``, saved in every checkpoint and snapshot.

A loop keeps what a resume must bring back: ``keep(name=object)`` for state
every rank shares (modules, optimizers, LR schedules, gradient scalers, the
user's own objects), ``keep_rank(name=object)`` for state each rank holds
for itself (a TBPTT hidden state, a stream's position). The built-in task
loop keeps ``model``, ``optimizer``, ``scheduler`` and ``scaler`` (and a
task's ``state``); a session script keeps what it names.

In a checkpoint each shared object's state sits at the top level under its
name, listed under ``kept``: a task job's checkpoint has the same ``model``,
``optimizer``, ``scheduler`` and ``scaler`` entries it always had, and one
written before ``kept`` existed reads as those four. Every rank's own
objects are gathered at each save into ``rank_kept`` (rank → name → state).
A resume loads each object in the call that keeps it; names kept now that the
checkpoint lacks, and names it holds that were never kept, are errors that
name both lists. At another world size the per-rank objects stay as they
were built, with one warning naming them.
"""

from __future__ import annotations

import collections
import io
import logging
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from service.config.errors import Refusal
from service.model.parallel import unwrap
from service.state.checkpoint_io import (  # noqa: F401 (TASK_KEPT: re-exported)
    TASK_KEPT,
    UnsafeCheckpointError,
    kept_names,
    load_tensors,
)
from service.telemetry.summary import model_digest

log = logging.getLogger(__name__)

# The loop's own entries of a checkpoint: no kept object may take one of these names.
RESERVED = frozenset({"format", "kept", "rank_kept", "loop", "rng", "world_size", "global_batch", "config",
                      "config_hash", "lineage", "versions", "first_bad", "data"})  # fmt: skip
STREAM = "__stream__"  # a stream's loader position, among each rank's own states (no user name looks like it)


class KeepError(TypeError, Refusal):
    """A kept object, its name or its call does not fit; the message names the call and the fix."""


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_EMPTY = torch.empty(0)


def _skeleton(value: Any) -> Any:
    """``value`` with each plain tensor swapped for an empty one: what a save pickles besides the tensors' data."""
    if type(value) in (torch.Tensor, nn.Parameter):
        return _EMPTY
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((key, _skeleton(item)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(_skeleton(item) for item in value)
    return value  # anything else goes as it is: the loader decides


def _odd_one(value: Any, path: str) -> tuple[str, str] | None:
    """(where, type) of the first value in ``value`` that is neither a tensor, a plain value nor a plain container."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return None
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            found = _odd_one(key, f"{path} key") or _odd_one(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple):
        return next(filter(None, (_odd_one(item, f"{path}[{index}]") for index, item in enumerate(value))), None)
    kind = type(value)
    return path, f"{kind.__module__}.{kind.__qualname__}"


def check_loadable(call: str, state: Any) -> None:
    """Refuse, before it is saved, a state that a resume's loader (``torch.load(weights_only=True)``) would refuse:
    the same loader is run on what the save pickles besides the tensors' data."""
    fix = ("A checkpoint is loaded back with torch.load(weights_only=True), which takes tensors and plain values "
           "(numbers, strings, None) in dicts, lists and tuples only, so nothing was saved. Make state_dict() "
           "return such values (e.g. the object's fields as a dict) and load_state_dict() build the object back "
           "from them.")  # fmt: skip
    buffer = io.BytesIO()
    try:
        torch.save(_skeleton(state), buffer)
        load_tensors(buffer.getvalue(), call)
    except (UnsafeCheckpointError, pickle.PicklingError, AttributeError, TypeError, ValueError) as exc:
        where, kind = _odd_one(state, "state_dict()") or ("state_dict()", str(exc).splitlines()[0][:200])
        raise KeepError(f"{call}: its {where} is a {kind}, which a resume could not load back. {fix}") from None


def describe(obj: Any) -> str:
    kind = type(obj)
    return f"a {kind.__module__}.{kind.__qualname__}"


def _has_state(obj: Any) -> bool:
    return all(callable(getattr(obj, method, None)) for method in ("state_dict", "load_state_dict"))


class Kept:
    """The objects a job keeps, restored from ``resumed`` (a checkpoint's state, or None) as they are kept."""

    def __init__(self, resumed: Mapping[str, Any] | None, rank: int, world_size: int, source: str = "") -> None:
        self.resumed = resumed
        self.rank, self.world_size, self.source = rank, world_size, source
        self.shared: dict[str, Any] = {}
        self.per_rank: dict[str, Any] = {}
        self.closed_for: str | None = None  # why keeping is over (training started)
        saved_size = resumed.get("world_size") if resumed is not None else None
        self._own_states = self._rank_states(resumed, saved_size)
        self._warned_resize = False
        self._checked = False  # every kept state loads back (checked once, before the first save)

    # ------------------------------------------------------------------ keeping
    def keep(self, objects: Mapping[str, Any], per_rank: bool, call: str) -> None:
        """Add ``objects`` (shared, or each rank's own); on a resume, load each one's saved state at once."""
        if self.closed_for is not None:
            raise KeepError(f"{call}({', '.join(objects)}) came after {self.closed_for}: everything a resume must "
                            f"bring back has to be kept before that, so that it is in the first checkpoint and "
                            f"restored before the first step. Move the {call}(...) call above it.")  # fmt: skip
        objects = {name: rng_kept(obj) for name, obj in objects.items()}
        for name, obj in objects.items():
            self._check(name, obj, call)
        for name, obj in objects.items():
            target = unwrap(obj) if isinstance(obj, nn.Module) else obj
            (self.per_rank if per_rank else self.shared)[name] = target
            self._restore(name, target, per_rank, call)

    def _check(self, name: str, obj: Any, call: str) -> None:
        if not name.isidentifier() or name in RESERVED:
            raise KeepError(f"{call}({name}=...): {name!r} is the name of one of the checkpoint's own entries "
                            f"({', '.join(sorted(RESERVED))}); keep it under another name.")  # fmt: skip
        if name in self.shared or name in self.per_rank:
            raise KeepError(f"{call}({name}=...): {name!r} is kept already; each name is kept once, by keep or "
                            "keep_rank.")  # fmt: skip
        if not _has_state(obj):
            raise KeepError(
                f"{call}({name}=...) got a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(): keep modules, optimizers, LR schedulers, GradScalers, random "
                "generators (torch.Generator, random.Random, numpy.random.Generator), or an object of your own with "
                "those two methods (service.Carry holds any value, e.g. a hidden state)."
            )

    def _restore(self, name: str, obj: Any, per_rank: bool, call: str) -> None:
        if self.resumed is None:
            return
        if per_rank:
            if self._own_states is None:
                self._warn_resize()
                return
            if name not in self._own_states:
                raise KeepError(self._mismatch(call, name, sorted(self._own_states), "keep_rank"))
            obj.load_state_dict(self._own_states[name])
            return
        if name not in kept_names(self.resumed):
            raise KeepError(self._mismatch(call, name, kept_names(self.resumed), "keep"))
        obj.load_state_dict(self.resumed.get(name))

    def _mismatch(self, call: str, name: str, saved: list[str], which: str) -> str:
        kept = self.per_rank if which == "keep_rank" else self.shared
        missing = [other for other in saved if other not in kept]
        return (f"{call}({name}=...): the checkpoint this run resumes from ({self.source}) holds no {name!r}: it "
                f"kept {', '.join(saved) or 'nothing'} with {which}. Unexpected: {name}. Missing so far: "
                f"{', '.join(missing) or 'none'}. Keep the same names as the run it resumes, or start afresh with "
                "--set checkpoint.resume=never.")  # fmt: skip

    def _rank_states(self, resumed: Mapping[str, Any] | None, saved_size: Any) -> dict[str, Any] | None:
        """This rank's own saved states: at the same world size only (None: another size, or none saved)."""
        if resumed is None:
            return {}
        by_rank = resumed.get("rank_kept") or {}
        if saved_size != self.world_size:
            return None if by_rank else {}
        return dict(by_rank.get(str(self.rank), {}))

    def saved_own(self) -> dict[str, Any] | None:
        """This rank's own saved states (None: saved at another world size)."""
        return self._own_states

    def _warn_resize(self) -> None:
        if not self._warned_resize and self.resumed is not None:
            self._warned_resize = True
            names = sorted(name for name in next(iter((self.resumed.get("rank_kept") or {}).values()), {})
                           if name != STREAM)  # fmt: skip
            log.warning("the per-rank objects %s were saved at world size %s and this start has %d ranks: each "
                        "rank's own state has no owner here, so they start as the script built them",
                        ", ".join(names), self.resumed.get("world_size"), self.world_size)  # fmt: skip

    def close(self, call: str) -> None:
        """Training starts: every saved name must have been kept (the missing ones are named), and no more keeping."""
        if self.resumed is not None:
            missing = [name for name in kept_names(self.resumed) if name not in self.shared]
            own = self._own_states or {}
            missing_rank = [name for name in own if name not in self.per_rank and name != STREAM]
            if missing or missing_rank:
                listed = ", ".join([*missing, *(f"{name} (per rank)" for name in missing_rank)])
                raise KeepError(f"the checkpoint this run resumes from ({self.source}) holds {listed}, which this "
                                f"run never kept before {call}. Missing: {listed}. Keep every object the run it "
                                "resumes kept (s.keep / s.keep_rank), or start afresh with --set "
                                "checkpoint.resume=never.")  # fmt: skip
        self.closed_for = call

    # ------------------------------------------------------------------ saving
    def check_loadable(self) -> None:
        """Once, before the first save (every rank at the first step's end; rank 0 again at its first save): each
        kept object's state must load back as a resume loads it, or a :class:`KeepError` names it, and its type."""
        if self._checked:
            return
        for per_rank, objects in ((False, self.shared), (True, self.per_rank)):
            for name, obj in objects.items():
                if name == STREAM:
                    call = f"s.batches({describe(getattr(obj, 'source', obj))}): the stream's state_dict()"
                    check_loadable(call + " (its loader's position, with the stream's own state)", obj.state_dict())
                else:
                    call = f"{'s.keep_rank' if per_rank else 's.keep'}({name}=...) ({describe(obj)})"
                    check_loadable(call, obj.state_dict())
        self._checked = True

    def states(self) -> dict[str, Any]:
        """Each shared object's state dict, by name (``kept`` lists the names)."""
        self.check_loadable()
        return {"kept": list(self.shared), **{name: obj.state_dict() for name, obj in self.shared.items()}}

    def own_payload(self) -> bytes:
        """This rank's own objects' states, serialized (for the gather at a save); empty without any."""
        if not self.per_rank:
            return b""
        self.check_loadable()
        buffer = io.BytesIO()
        torch.save({name: obj.state_dict() for name, obj in self.per_rank.items()}, buffer)
        return buffer.getvalue()

    @staticmethod
    def gathered(payloads: list[bytes]) -> dict[str, Any]:
        """Every rank's own states from the gathered payloads: ``rank_kept`` (checked like any checkpoint)."""
        return {str(rank): load_tensors(payload, f"rank {rank}'s kept state") for rank, payload in enumerate(payloads)
                if payload}  # fmt: skip

    def modules(self) -> Iterator[nn.Module]:
        return (obj for obj in self.shared.values() if isinstance(obj, nn.Module))

    def digest(self) -> str:
        """The ``model_digest`` of summary.json: every kept module's tensors, in the order they were kept."""
        return model_digest(module.state_dict() for module in self.modules())

    def module(self, name: str | None = None) -> nn.Module | None:
        """A kept module by name, or the first one."""
        found = self.shared.get(name) if name is not None else next(self.modules(), None)
        return found if isinstance(found, nn.Module) else None


class KeptRNG:
    """A script's own random generator as a kept object: ``torch.Generator``, ``random.Random`` or
    ``numpy.random.Generator`` (a gymnasium env's ``np_random``). Its state is saved as tensors and strings, so a
    resume loads it with the safe loader; the per-step seeding of torch's, ``random``'s and numpy's global generators
    (:func:`service.loop.stepping.seed_step`) never touches such a generator, so keep it to resume exactly."""

    def __init__(self, rng: Any) -> None:
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        import json
        import random

        rng = self.rng
        if isinstance(rng, torch.Generator):
            return {"torch": rng.get_state()}
        if isinstance(rng, random.Random):
            version, internal, gauss = rng.getstate()
            return {"random": torch.tensor(internal, dtype=torch.int64), "version": version, "gauss": gauss}
        return {"numpy": json.dumps(rng.bit_generator.state, default=lambda value: value.tolist())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import json

        rng = self.rng
        if isinstance(rng, torch.Generator):
            rng.set_state(state["torch"])
        elif "random" in state:
            rng.setstate((state["version"], tuple(int(value) for value in state["random"].tolist()), state["gauss"]))
        else:
            rng.bit_generator.state = json.loads(state["numpy"])


def rng_kept(obj: Any) -> Any:
    """``obj`` itself, or a :class:`KeptRNG` around it when it is a random generator without a state_dict."""
    import random

    if isinstance(obj, (torch.Generator, random.Random)) or type(obj).__module__.startswith("numpy.random") and (
            type(obj).__name__ == "Generator"):  # fmt: skip
        return KeptRNG(obj)
    return obj


class Carry:
    """A value kept across steps and restored on a resume: ``s.keep_rank(hidden=carry)`` (each rank's own) or
    ``s.keep(...)``; set ``carry.value`` after each step, read it back with :meth:`take`.

    Holds any nesting of tensors and numbers (a TBPTT hidden state: a tensor or a tuple of them); ``state_dict``
    keeps tensors detached, on the CPU, and a session's ``keep`` brings them back onto its device.
    """

    def __init__(self, value: Any = None, on_load: Callable[[Any], Any] | None = None) -> None:
        self.value = value
        self.on_load = on_load  # e.g. lambda value: value.to(device)
        self._restored = False

    def take(self, default: Any = None) -> Any:
        """The value a resume restored, once; ``default`` otherwise: ``hidden = carry.take(model.init_hidden(bsz))``
        starts each epoch as the uninterrupted run does, and a resumed one where it stopped."""
        if not self._restored:
            return default
        self._restored = False
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": _detached(self.value)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        value = state.get("value")
        self.value = self.on_load(value) if self.on_load is not None and value is not None else value
        self._restored = value is not None


class Variables:
    """A script's own variables, by name, in a namespace (a module's ``globals()``): kept and restored as they
    are, e.g. ``s.keep(script=service.Variables(globals(), "lr", "best_val_loss"))`` for a learning rate a script
    anneals by hand between epochs. Numbers, strings, None and tensors (in plain containers)."""

    def __init__(self, namespace: dict[str, Any], *names: str) -> None:
        missing = [name for name in names if name not in namespace]
        if missing:
            raise KeepError(f"service.Variables(..., {', '.join(map(repr, names))}): {', '.join(missing)} not "
                            "defined yet; keep a variable after the line that first sets it.")  # fmt: skip
        self.namespace, self.names = namespace, names

    def state_dict(self) -> dict[str, Any]:
        return {name: _detached(self.namespace[name]) for name in self.names}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in self.names:
            if name in state:
                self.namespace[name] = state[name]


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(item) for item in value)
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    return value
