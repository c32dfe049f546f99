"""Issue 35, the data side without torchrun: a ``datasets`` stream read whole at every loader worker count, loaders
shut down by the loop (their workers ignore SIGTERM), and kept state checked against the resume's loader."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from service.config import DataConfig
from service.data.feeds import StreamFeed, is_hf_stream, is_stream
from service.data.loaders import shut_down
from service.loop.kept import KeepError, check_loadable
from service.state.checkpoint_io import _RESUME_FIX
from service.state.preemption import ignore_in_data_workers


def trained(files: list[str], workers: int) -> dict[int, list[int]]:
    """Each rank's ids (a world of 2, 4 a batch) as the session's stream feed reads them."""
    from datasets import load_dataset

    seen = {}
    for rank in (0, 1):
        stream = load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")
        assert is_hf_stream(stream) and is_stream(stream)
        feed = StreamFeed(stream, 4, 2, rank, DataConfig(num_workers=workers), 0, None, lambda flags: list(flags))
        try:
            seen[rank] = [i for fed in feed.steps(0, 0) for i in fed.batches[0]["id"].tolist()]
        finally:
            feed.close()
    return seen


@pytest.mark.e2e  # loader worker processes
@pytest.mark.parametrize("files", [1, 4])
def test_a_datasets_stream_trains_the_same_samples_at_1_2_and_3_loader_workers_as_at_0(tmp_path: Path,
                                                                                       files: int) -> None:  # fmt: skip
    """A ``datasets`` stream splits its shards over a loader's workers itself (a worker past its shards gets none):
    sharded by ``split_dataset_by_node`` (not the torch stream's every-worker-reads-all slots) it trains the same
    samples at 1, 2 and 3 workers as at 0: every one of them, each once (2 workers used to train half, 3 a third)."""
    paths = []
    for part in range(files):
        path = tmp_path / f"part{part}.jsonl"
        path.write_text("".join(json.dumps({"id": part * 1000 + line}) + "\n" for line in range(32 // files * 2)))
        paths.append(str(path))
    alone = trained(paths, 0)
    every = sorted(part * 1000 + line for part in range(files) for line in range(32 // files * 2))
    assert sorted(alone[0] + alone[1]) == every
    for workers in (1, 2, 3):
        seen = trained(paths, workers)
        assert {rank: sorted(ids) for rank, ids in seen.items()} == {rank: sorted(ids) for rank, ids in alone.items()}


class Slow(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            time.sleep(0.01)
            yield torch.zeros(2)


@pytest.mark.e2e  # loader worker processes
def test_shut_down_stops_a_loaders_workers_that_ignore_sigterm() -> None:
    """The loop's own shutdown of a loader left open (a stream cut by max_steps): its workers, which ignore the stop
    signals, are gone within seconds; Python's exit would have waited on them for good."""
    loader = DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=ignore_in_data_workers,
                        persistent_workers=True)  # fmt: skip
    batches = iter(loader)
    next(batches)
    workers = list(batches._workers)  # type: ignore[attr-defined]
    assert all(worker.is_alive() for worker in workers)
    started = time.monotonic()
    shut_down(loader)
    assert not any(worker.is_alive() for worker in workers) and time.monotonic() - started < 10
    shut_down(loader)  # twice, or on a loader never iterated: nothing to do
    shut_down(DataLoader([1, 2, 3]))


class Custom:
    pass


def test_kept_state_is_checked_by_the_resumes_loader_before_it_is_saved() -> None:
    """What ``s.keep`` / ``s.keep_rank`` / a stream's state_dict hold must load with ``weights_only=True``: a custom
    object or a function is refused, naming the call, where it sits and its type; a model's, an optimizer's, a
    schedule's and a scaler's states pass (their tensors are not serialized for the check)."""
    cases = (({"step": 3, "inner": Custom()}, "state_dict()['inner']", f"{__name__}.Custom"),
             ({"fns": [1, {"f": len}]}, "state_dict()['fns'][1]['f']", "builtins.builtin_function_or_method"),
             ({Custom(): 1}, "state_dict() key", f"{__name__}.Custom"))  # fmt: skip
    for state, where, kind in cases:
        with pytest.raises(KeepError) as refused:
            check_loadable("s.keep(thing=...)", state)
        assert str(refused.value).startswith(f"s.keep(thing=...): its {where} is a {kind}, which a resume could not "
                                             "load back."), str(refused.value)  # fmt: skip
        assert "nothing was saved" in str(refused.value) and refused.value.code == 2
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    plain = {"o": collections.OrderedDict(w=torch.zeros(2)), "t": (1, 2.5, "s", None, b"x", torch.float16)}
    for state in (model.state_dict(), optimizer.state_dict(), schedule.state_dict(),
                  torch.amp.GradScaler("cpu").state_dict(), plain):  # fmt: skip
        check_loadable("s.keep(x=...)", state)


def test_a_refused_load_never_says_to_delete_a_checkpoint() -> None:
    assert "delete" not in _RESUME_FIX and "checkpoint.resume=never" in _RESUME_FIX


class Plain(torch.utils.data.IterableDataset):
    """A torch stream without state_dict: numbers without end."""

    def __iter__(self):
        index = 0
        while True:
            yield torch.tensor(index)
            index += 1


@pytest.mark.e2e  # loader worker processes
def test_a_stream_without_state_reads_through_loader_workers_and_keeps_no_position() -> None:
    """A torch stream without ``state_dict``, sharded over 2 ranks and 2 workers a rank: its workers read it (they
    used to fail in the worker, asking the stream for a state_dict it lacks, naming neither), and it keeps no
    position (a resume mid-epoch is refused naming data.stream_resume, or restarts it under ``restart``)."""
    feed = StreamFeed(Plain(), 2, 2, 1, DataConfig(num_workers=2), 0, None, lambda flags: list(flags))
    try:
        steps = feed.steps(0, 0)
        seen = [next(steps).batches[0].tolist() for _ in range(4)]
        assert sorted(i for batch in seen for i in batch) == [2, 3, 6, 7, 10, 11, 14, 15]  # slots 2 and 3 of 4
        assert not feed.resumable and feed.state_dict() is None
    finally:
        feed.close()


@pytest.mark.e2e  # loader worker processes
@pytest.mark.parametrize(
    ("task", "ends"),
    [(("task=stream_tasks:numbers", "train.batch_size=4", "train.max_steps=3"), "completed"),
     (("task=nan_tasks:nan_at", "task_options.steps=[3]"), "failed")],
)  # fmt: skip
def test_the_task_loop_shuts_its_loaders_workers_down_when_it_returns_or_raises(tmp_path: Path, monkeypatch,
                                                                               task, ends) -> None:  # fmt: skip
    """#35.1, the Task loop (a world of one, in this process, run as ``ddp-service train`` runs it): when ``train``
    returns (a stream cut by max_steps, its feed still kept by the runtime as the stream's position) or raises (a
    map-style loader's persistent workers, held by the traceback's frames), no worker of its loader is alive. Left
    to the runtime's end, a stream's worker in a blocking read held ``ddp-service train`` (alone, 2 workers) 35 s
    past its ``done:`` line, until the read returned; the loop's own shut-down kills such a worker (that run left
    0.04 s after its ``done:``)."""
    import multiprocessing

    from conftest import REPO

    from service.config import load_config
    from service.loop.runtime import Runtime
    from service.loop.train import run_task
    from service.model.nonfinite import NonfiniteError
    from service.state.preemption import Preemption
    from service.world.env import detect_world

    monkeypatch.syspath_prepend(str(REPO / "tests" / "tasks"))
    config = load_config(None, [f"run_dir={tmp_path}", "data.num_workers=2", "train.progress_bar=false",
                                "metrics.tensorboard=false", "checkpoint.every_steps=0", *task])  # fmt: skip
    before, preemption = set(multiprocessing.active_children()), Preemption()
    try:
        with Runtime.opened(config, detect_world({}), preemption) as runtime:
            try:
                if ends == "failed":
                    with pytest.raises(NonfiniteError):
                        run_task(runtime)
                else:
                    assert run_task(runtime)["global_step"] == 3
                left = [child for child in multiprocessing.active_children() if child not in before]
            finally:
                if runtime.feed is not None:  # a failure below: its workers ignore SIGTERM, and would hold pytest
                    runtime.feed.close()
            assert not left, f"the loader's workers {left} outlived the loop"
    finally:
        preemption.close()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == ends
