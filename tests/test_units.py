"""Fast tests of the pure pieces: schedule, step plan, digest, checkpoints, device choice, SyncBN math."""

from __future__ import annotations

import json
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from service.config import TrainConfig, load_config
from service.config.errors import INPLACE_MARKER, InplaceGradientError, backward
from service.data.sampler import DataPlan
from service.loop.train import batch_geometry, plan_total_steps
from service.model.parallel import wants_sync_batchnorm, wrap_model
from service.model.schedule import lr_factor
from service.model.syncbn import AllReduceBatchNorm, convert_sync_batchnorm
from service.state.checkpoint import Rank0Checkpointer
from service.state.checkpoint_io import candidate_steps
from service.state.loop_state import LoopState
from service.telemetry.summary import JsonSummaryWriter, model_digest
from service.world.distributed import attempt_store, select_backend, select_device, store_namespace
from service.world.env import EnvError, WorldInfo


def test_lr_factor_warmup_then_cosine():
    assert lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0)
    assert lr_factor(70, 100, 0, "constant") == 1.0


@pytest.mark.parametrize(
    ("length", "batch", "accum", "epochs", "max_steps", "expected"),
    [(80, 8, 1, 2, None, 20), (80, 8, 3, 2, None, 8), (80, 8, 1, 5, 7, 7), (8, 8, 4, 1, None, 1)],
)
def test_plan_total_steps(length, batch, accum, epochs, max_steps, expected):
    train = TrainConfig(batch_size=batch, grad_accum=accum, epochs=epochs, max_steps=max_steps)
    global_batch, micro = batch_geometry(train, 1)
    plan = DataPlan(length, 0, global_batch, 1, 0, micro)
    assert plan_total_steps(plan, LoopState(), train) == expected


def test_model_digest_covers_values_and_order():
    state = {"a": torch.arange(4.0), "b": torch.ones(2, 2).t(), "n": torch.tensor(3)}
    digest = model_digest([state])
    assert digest == model_digest([{k: v.clone() for k, v in state.items()}])
    assert digest != model_digest([{**state, "n": torch.tensor(4)}])
    assert digest != model_digest([{"b": state["b"], "a": state["a"], "n": state["n"]}])
    assert model_digest([{"x": torch.ones(2, dtype=torch.bfloat16)}]) != model_digest([{"x": torch.ones(2)}])
    assert digest == model_digest([{"a": state["a"]}, {"b": state["b"], "n": state["n"]}])  # modules in turn


def test_checkpointer_saves_on_schedule_and_keeps_the_last(tmp_path):
    saver = Rank0Checkpointer(tmp_path, every_steps=2, keep=2, config_hash="0" * 64, on_error="stop",
                              async_save=False)  # fmt: skip
    calls = []

    def state():
        calls.append(1)
        return {"model": {"w": torch.ones(1)}}

    for step in range(1, 8):
        saver.maybe_save(step, state)
    saver.save(6, state)  # already saved at step 6 by this process: not written twice
    assert candidate_steps(tmp_path) == [6, 4]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "step-00000004.json", "step-00000004.pt", "step-00000006.json", "step-00000006.pt"]  # fmt: skip
    assert len(calls) == 3


def test_summary_writer_is_atomic_json(tmp_path):
    JsonSummaryWriter(tmp_path / "s" / "summary.json").write({"x": 1})
    assert json.loads((tmp_path / "s" / "summary.json").read_text()) == {"x": 1}


def test_backend_and_device_choice():
    assert select_backend("auto", cuda_available=False) == "gloo"
    assert select_backend("auto", cuda_available=True) == "nccl"
    with pytest.raises(EnvError, match="no CUDA device is visible"):
        select_backend("nccl", cuda_available=False)
    world = WorldInfo("torchrun", rank=5, local_rank=1, world_size=8, local_world_size=4)
    assert select_device(world, "gloo", 4) == torch.device("cpu")
    assert select_device(world, "nccl", 4) == torch.device("cuda", 1)
    assert select_device(world, "nccl", 1) == torch.device("cuda", 0)  # one visible device per process
    with pytest.raises(EnvError, match="LOCAL_RANK=3 but only 2 CUDA devices"):
        select_device(WorldInfo("torchrun", 3, 3, 4, 4), "nccl", 2)


def test_attempt_store_namespaces_each_restart(unused_tcp_port):
    """Workers of restart 1 must not see what workers of restart 0 wrote in the agent's shared store."""
    agent_store = dist.TCPStore("127.0.0.1", unused_tcp_port, is_master=True, wait_for_workers=False)

    def worker_store(restart: int) -> dist.Store:
        world = WorldInfo("torchrun", rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                          master_port=unused_tcp_port, restart_count=restart, use_agent_store=True)  # fmt: skip
        return attempt_store(world, timedelta(seconds=5))

    worker_store(0).set("rank0-address", "old")
    assert worker_store(0).check(["rank0-address"])
    assert not worker_store(1).check(["rank0-address"])
    assert agent_store.num_keys() >= 1


def test_store_namespace_only_counts_attempts_in_a_shared_store():
    shared = WorldInfo("torchrun", restart_count=2, use_agent_store=True)
    fresh = WorldInfo("torchrun", restart_count=2, use_agent_store=False)
    assert store_namespace(shared) == "ddp-service/attempt-2/"
    # Agents' restart counts differ after a membership change; a fresh store needs no attempt key.
    assert store_namespace(fresh) == store_namespace(WorldInfo("torchrun", restart_count=0)) == "ddp-service/"


def test_sync_batchnorm_switch():
    assert wants_sync_batchnorm("auto", 2) and not wants_sync_batchnorm("auto", 1)
    assert wants_sync_batchnorm("on", 1) and not wants_sync_batchnorm("off", 8)


def test_backward_adds_the_hint_for_inplace_errors():
    x = torch.ones(3, requires_grad=True)
    y = torch.sigmoid(x)
    y.mul_(2)
    with pytest.raises(InplaceGradientError) as info:
        backward(y.sum())
    assert INPLACE_MARKER in str(info.value) and "ddp.broadcast_buffers: false" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_backward_leaves_other_errors_alone():
    with pytest.raises(RuntimeError) as info:
        backward(torch.ones(2, requires_grad=True))  # not a scalar
    assert not isinstance(info.value, InplaceGradientError)


@pytest.fixture
def world_of_one():
    """A real gloo process group of one process, as the service builds it without a launcher."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield WorldInfo("none")
    dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (6, 4, 5, 3)])
def test_allreduce_batchnorm_matches_batchnorm_in_a_world_of_one(world_of_one, shape):
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(4) if len(shape) < 4 else nn.BatchNorm2d(4)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    synced = convert_sync_batchnorm(nn.Sequential(reference), "cpu")[0]
    reference = nn.BatchNorm1d(4) if len(shape) < 4 else nn.BatchNorm2d(4)
    reference.load_state_dict(synced.state_dict())
    assert isinstance(synced, AllReduceBatchNorm)
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    for _ in range(2):
        out, expected = synced(x), reference(x2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(synced.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(synced.running_var, reference.running_var)
    assert synced.num_batches_tracked.item() == 2
    synced.eval(), reference.eval()
    torch.testing.assert_close(synced(x), reference(x2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_allreduce_batchnorm_under_autocast_behaves_like_batchnorm(world_of_one, dtype):
    """train.amp with BatchNorm (#24.1): a half-precision input out of a conv under autocast gives an output of
    its dtype, and float32 running statistics equal to torch's own BatchNorm's (its lerp_ failed before)."""
    torch.manual_seed(0)
    conv, reference = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
    synced = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), "cpu")[0]
    x = torch.randn(6, 3, 5, 5)
    with torch.autocast("cpu", dtype=dtype):
        hidden = conv(x)
        out, expected = synced(hidden), reference(hidden)
    assert hidden.dtype == out.dtype == expected.dtype == dtype
    assert synced.running_mean.dtype == synced.running_var.dtype == torch.float32
    torch.testing.assert_close(synced.running_mean, reference.running_mean, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(synced.running_var, reference.running_var, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert synced.weight.grad is not None and synced.weight.grad.dtype == torch.float32


def test_dp_strategy_refuses_several_processes_and_warns_on_cpu(world_of_one, caplog):
    train = load_config(None, ["train.strategy=dp"]).train
    ddp = load_config(None).ddp
    with pytest.raises(EnvError, match="DataParallel runs in one process"):
        wrap_model(nn.Linear(2, 2), train, ddp, WorldInfo("torchrun", 0, 0, 2, 2, master_addr="h", master_port=1),
                   torch.device("cpu"))  # fmt: skip
    with caplog.at_level("WARNING"):
        model = wrap_model(nn.Linear(2, 2), train, ddp, world_of_one, torch.device("cpu"))
    assert isinstance(model, nn.Linear) and "single process" in caplog.text


@pytest.fixture
def unused_tcp_port() -> int:
    from rendezvous.conftest import free_port

    return free_port()


def test_cosine_reaches_zero_only_at_the_end():
    values = [lr_factor(step, 20, 0, "cosine") for step in range(20)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert values[-1] > 0 and math.isclose(lr_factor(20, 20, 0, "cosine"), 0.0, abs_tol=1e-12)


def test_the_optimizer_step_lists_the_model_parameters_once_per_job_not_per_step(world_of_one, tmp_path):
    """``list(model.parameters())`` walks every module of the DDP wrapper (~50 µs of a ~18 ms CPU step, issue 17):
    the step clips and checks the list ``build_job`` made, and still trains the live parameters."""
    import contextlib
    import types

    from service.loop.task_step import TaskStep
    from service.loop.train import optimizer_step
    from service.model.nonfinite import NonfiniteGuard
    from service.model.precision import Precision
    from service.state.snapshot import Snapshots
    from service.tasks.base import Task
    from service.telemetry.progress import Progress

    torch.manual_seed(0)
    data = (torch.randn(12, 5), torch.randn(12, 1))
    config = load_config(None, ["train.grad_clip=1.0"])
    model = wrap_model(nn.Linear(5, 1), config.train, config.ddp, world_of_one, torch.device("cpu"))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    calls = []
    listing = model.parameters
    model.parameters = lambda *args, **kwargs: calls.append(1) or listing(*args, **kwargs)
    job = types.SimpleNamespace(
        model=model, params=params, device=torch.device("cpu"), autocast=contextlib.nullcontext,
        precision=Precision(None, torch.device("cpu"), None),
        step=TaskStep(Task(model, data, data, loss_fn=nn.functional.mse_loss), "mse"),
        nonfinite=NonfiniteGuard("stop", 1.0, torch.device("cpu"), tmp_path, (), 3),
        optimizer=torch.optim.SGD(params, lr=0.1), scheduler=types.SimpleNamespace(step=lambda: None),
        roles=types.SimpleNamespace(snapshots=Snapshots()),
        progress=Progress(),
    )  # fmt: skip
    for number, step in enumerate(DataPlan(12, 0, 4, 1, 0, 1).steps(0, 0), 1):
        optimizer_step(
            job, step, [(data[0][list(step.micro[0].indices)], data[1][list(step.micro[0].indices)])], number
        )  # type: ignore[arg-type]
    assert not calls, f"{len(calls)} optimizer steps listed the model's parameters {len(calls)} times"
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True)), "the steps moved no weight"
