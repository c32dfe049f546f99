"""Issue 17, part 2 (fast, in-process): train.amp=fp16's scaler, train.compile's unwrapping, train.min_lr."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from service.config import ConfigError, build_config
from service.loop.kept import Kept
from service.model.nonfinite import NonfiniteError, NonfiniteGuard
from service.model.parallel import compile_in_place, unwrap
from service.model.precision import Precision, PrecisionStateError
from service.model.schedule import lr_factor
from service.state.resume import config_hash, incompatible_fields

CPU = torch.device("cpu")


def _fp16() -> Precision:
    return Precision.for_job("fp16", CPU)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _step(model: nn.Module, guard: NonfiniteGuard, optimizer: torch.optim.Optimizer, step: int,
          factor: float = 1.0) -> None:  # fmt: skip
    """One real optimizer step through the precision and the guard, as ``optimizer_step`` runs it."""
    generator = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)
    with guard.precision.autocast():
        loss = nn.functional.cross_entropy(model(inputs), targets) * factor
    guard.precision.backward(loss)
    guard.step(list(model.parameters()), optimizer, step)
    optimizer.zero_grad(set_to_none=True)


def test_precision_settings_pick_dtype_and_scaler():
    assert (_fp16().dtype, _fp16().scaler is not None) == (torch.float16, True)
    for setting, dtype in (("bf16", torch.bfloat16), ("auto", None), ("off", None)):
        precision = Precision.for_job(setting, CPU)
        assert (precision.dtype, precision.scaler, precision.state_dict()) == (dtype, None, None)
    assert Precision.for_job("auto", torch.device("cuda")).dtype == torch.bfloat16  # builds nothing on the device


def test_fp16_trains_on_cpu_and_clips_the_unscaled_gradient(tmp_path: Path):
    """Real fp16 autocast on CPU; the clip sees true gradients: SGD's update has the clip's norm, not 1/65536 of it."""
    model, precision = _model(), _fp16()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    guard = NonfiniteGuard("stop", 1e-3, CPU, tmp_path, (), 10, precision)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with precision.autocast():
        assert model(torch.randn(2, 8)).dtype == torch.float16
    _step(model, guard, optimizer, 1)
    moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    assert math.isclose(moved.norm().item(), 1e-3, rel_tol=1e-3), moved.norm().item()
    assert precision.scale == 65536.0 and guard.skipped == 0
    for step in range(2, 6):
        _step(model, guard, optimizer, step)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_fp16_overflow_is_skipped_counted_and_does_not_trip_stop(tmp_path: Path, caplog):
    model, precision = _model(), _fp16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = NonfiniteGuard("stop", 1.0, CPU, tmp_path, (), 10, precision)
    _step(model, guard, optimizer, 1)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING):
        _step(model, guard, optimizer, 2, factor=1e30)  # finite loss; its scaled gradient overflows float16
    assert guard.skipped == 1 and precision.scale == 32768.0
    assert "step 2: the gradient norm is" in caplog.text and "lowers its scale from 65536 to 32768" in caplog.text
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), f"the skipped step moved {name}"
    for param, buffer in zip(model.parameters(), momentum, strict=True):
        assert torch.equal(optimizer.state[param]["momentum_buffer"], buffer), "the skipped step moved momentum"
    guard.raise_if_bad()  # a scaler skip is not a diverged loss
    _step(model, guard, optimizer, 3)
    assert guard.skipped == 1 and not torch.equal(model.state_dict()["0.weight"], weights["0.weight"])


def test_fp16_overflow_at_every_step_stops_once_the_scale_is_down_to_one(tmp_path: Path):
    """A diverged loss overflows at every scale: at scale 1 the scaler cannot be the cause, and stop fails there."""
    model, precision = _model(), _fp16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonfiniteGuard("stop", None, CPU, tmp_path, (), 100, precision)
    _step(model, guard, optimizer, 1)
    step = 2
    while precision.scale > 1.0:
        _step(model, guard, optimizer, step, factor=float("nan"))
        guard.raise_if_bad()
        step += 1
    assert step == 18  # 2**16 halved 16 times
    _step(model, guard, optimizer, step, factor=float("nan"))
    with pytest.raises(NonfiniteError, match=r"at step 2 is not finite.*skipped every step from 2 to 18"):
        guard.raise_if_bad()
    assert guard.skipped == 17 and all(torch.isfinite(p).all() for p in model.parameters())


def test_under_skip_an_fp16_overflow_at_scale_one_is_skipped_without_failing(tmp_path: Path):
    model, precision = _model(), _fp16()
    precision.load_state_dict({**precision.scaler.state_dict(), "scale": 1.0})  # type: ignore[union-attr]
    guard = NonfiniteGuard("skip", None, CPU, tmp_path, (), 10, precision)
    _step(model, guard, torch.optim.SGD(model.parameters(), lr=0.1), 1, factor=float("inf"))
    guard.raise_if_bad()
    assert guard.skipped == 1


def restore(state, model, optimizer, scheduler, scaler) -> None:  # noqa: ANN001
    """A task job's four kept objects, loaded from ``state`` as a resume loads them (service.loop.kept)."""
    kept = Kept(state, 0, 2, "step-4.pt")
    kept.keep({"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}, False, "keep")


def test_the_scaler_state_round_trips_exactly_through_restore():
    model, precision = _model(), _fp16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonfiniteGuard("stop", 1.0, CPU, Path("."), (), 10, precision)
    for step, factor in ((1, 1.0), (2, 1e30), (3, 1.0), (4, 1.0)):
        _step(model, guard, optimizer, step, factor)
    saved = precision.state_dict()
    assert saved is not None and (saved["scale"], saved["_growth_tracker"]) == (32768.0, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": {"torch": torch.get_rng_state()}, "scaler": saved}  # fmt: skip
    fresh = _fp16()
    restore(state, _model(), optimizer, scheduler, fresh)
    assert fresh.state_dict() == saved
    fresh.scaler.scale(torch.ones(()))  # type: ignore[union-attr]  (the scale tensor is made at first use)
    assert fresh.scale == 32768.0
    # A checkpoint of a bf16/fp32 run (or an older one) holds None, or no entry: it loads without a scaler.
    for old in ({**state, "scaler": None}, {k: v for k, v in state.items() if k != "scaler"}):
        restore(old, _model(), optimizer, scheduler, Precision.for_job("off", CPU))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (None, r"no gradient scaler state \(its 'scaler' entry is None\)"),
        ({"scale": 1.0}, r"its 'scaler' entry is a mapping of \['scale'\]"),
        (b"scale", "its 'scaler' entry is a bytes"),
        ("bad-scale", r"scale=nan; it must be a positive finite float"),
        ("zero-scale", r"scale=0.0; it must be a positive finite float"),  # every loss times 0: no gradient at all
        ("bad-tracker", r"_growth_tracker=-1; it must be a non-negative finite int"),
        ("bool", r"growth_interval=True"),
    ],
)
def test_a_damaged_scaler_entry_is_refused_with_the_fix(entry, message):
    good = _fp16().scaler.state_dict()  # type: ignore[union-attr]
    damaged = {"bad-scale": {**good, "scale": float("nan")}, "zero-scale": {**good, "scale": 0.0},
               "bad-tracker": {**good, "_growth_tracker": -1}, "bool": {**good, "growth_interval": True}}  # fmt: skip
    entry = damaged[entry] if isinstance(entry, str) else entry
    with pytest.raises(PrecisionStateError, match=message) as caught:
        _fp16().load_state_dict(entry, "step-00000004.pt")
    assert "checkpoint.resume=never" in str(caught.value)


def test_unwrap_strips_torch_compile_and_in_place_compile_keeps_the_keys():
    model = _model()
    keys = list(model.state_dict())
    wrapped = torch.compile(model, backend="eager")
    assert list(wrapped.state_dict())[0].startswith("_orig_mod.")  # what unwrap is for
    assert unwrap(wrapped) is model and unwrap(nn.DataParallel(wrapped)) is model
    compile_in_place(model, "eager")
    assert list(model.state_dict()) == keys and unwrap(model) is model
    inputs = torch.randn(3, 8)
    assert torch.equal(model(inputs), _model()(inputs))


def test_config_of_the_new_options_and_which_may_change_on_resume():
    with pytest.raises(ConfigError, match=r"train.min_lr=0.1 is above train.lr=0.05.*--set train.min_lr=0"):
        build_config({"train": {"min_lr": 0.1}})
    with pytest.raises(ConfigError, match="train.compile works with train.strategy=ddp only"):
        build_config({"train": {"compile": True, "strategy": "dp"}})
    with pytest.raises(ConfigError, match=r"train.compile: Input should be False, True, 'inductor'"):
        build_config({"train": {"compile": "yes"}})
    base = build_config({"train": {"amp": "fp16", "min_lr": 0.05, "lr_schedule": "linear"}})
    compiled = build_config({"train": {"amp": "fp16", "min_lr": 0.05, "lr_schedule": "linear", "compile": True}})
    assert config_hash(base) == config_hash(compiled)  # compile is mutable: eager and compiled resume each other
    assert incompatible_fields(base.model_dump(mode="json"), build_config({"train": {"min_lr": 0.05,
                               "lr_schedule": "linear"}})) == ["train.amp ('fp16' -> 'auto')"]  # fmt: skip


@given(
    total=st.integers(1, 500),
    warmup=st.integers(0, 50),
    schedule=st.sampled_from(["cosine", "linear"]),
    floor=st.floats(0.0, 1.0),
    step=st.integers(0, 600),
)
def test_the_decay_never_goes_below_min_lr_and_ends_there(total, warmup, schedule, floor, step):
    """Past warm-up: within [floor, 1], 1 where the decay starts, the floor from total_steps on, never rising."""
    value = lr_factor(step, total, warmup, schedule, floor)
    if step < warmup:
        assert value == (step + 1) / warmup  # warm-up ramps to 1 whatever the floor
        return
    assert floor <= value <= 1.0
    assert lr_factor(warmup, total, warmup, schedule, floor) == 1.0
    if step >= total > warmup:  # (with warm-up over all of the run there is no decay)
        assert value == pytest.approx(floor, abs=1e-12)
    assert lr_factor(step + 1, total, warmup, schedule, floor) <= value


def test_min_lr_and_linear_by_the_numbers():
    assert lr_factor(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(55, 100, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(55, 100, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "linear", 0.2) == pytest.approx(0.2)
    assert lr_factor(0, 100, 10, "linear", 0.2) == pytest.approx(0.1)
