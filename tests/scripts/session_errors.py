"""Each misuse of the session API in a session of its own (a world of one, one process): what it raised, as JSON
``{case: [error type, message] or null}``. Usage: ``session_errors.py OUT DIR``."""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import service

out, base = sys.argv[1], Path(sys.argv[2])
DATA = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
QUICK = ["train.progress_bar=false", "metrics.tensorboard=false", "train.log_every=2", "metrics.goodput=false"]


class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(4)


def session(name: str, *extra: str) -> service.Session:
    return service.Session(overrides=[f"run_dir={base / name}", *QUICK, *extra])


def batches_before_keep(s):
    net = s.model(nn.Linear(4, 1))
    for _ in s.batches(DATA, 8):
        net.zero_grad()


def batches_of_another_dataset(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    for epoch in s.epochs():
        for _ in s.batches(DATA if epoch == 0 else TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), 8):
            pass


def model_after_training_started(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    for _ in s.batches(DATA, 8):
        s.model(nn.Linear(4, 1))


def keep_after_training_started(s):
    net = s.model(nn.Linear(4, 1))
    s.keep(net=net)
    for _ in s.batches(DATA, 8):
        s.keep(opt=torch.optim.SGD(net.parameters(), lr=0.1))


def keep_without_state_dict(s):
    s.keep(net=s.model(nn.Linear(4, 1)), lr=0.1)


def model_of_a_wrapped_module(s):
    net = s.model(nn.Linear(4, 1))
    s.model(net)


def log_of_a_vector(s):
    net = s.model(nn.Linear(4, 1))
    s.keep(net=net)
    for x, _ in s.batches(DATA, 8):
        s.log(outputs=net(x))


def stream_without_max_steps(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    for _ in s.batches(Endless(), 8):
        pass


class Empty(IterableDataset):
    def __iter__(self):
        return iter([])


def empty_stream(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    for _ in s.batches(Empty(), 8):
        pass


def keep_a_reserved_name(s):
    s.keep(loop=s.model(nn.Linear(4, 1)))


def train_two_kept(s):
    g, d = s.model(nn.Linear(4, 1)), s.model(nn.Linear(4, 1))
    s.keep(netG=g, netD=d)
    for _ in s.batches(DATA, 8):
        pass


def resume_unexpected_name(s):
    g = s.model(nn.Linear(4, 1))
    s.keep(netG=g, optG=torch.optim.SGD(g.parameters(), lr=0.1))


def resume_missing_name(s):
    g = s.model(nn.Linear(4, 1))
    s.keep(netG=g)
    for _ in s.batches(DATA, 8):
        pass


def plain_step(s):
    net = s.model(nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    s.keep(net=net, opt=opt)
    for x, y in s.batches(DATA, 8):
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def micro_batches_indivisible(s):
    net = s.model(nn.Linear(4, 1))
    s.keep(net=net)
    for batch in s.batches(DATA, 8):
        for _ in s.micro_batches(batch):
            pass


def nested_batches(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    for _ in s.batches(DATA, 8):
        for _ in s.batches(DATA, 8):
            pass


def batches_side_by_side(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    first, second = s.batches(DATA, 8), s.batches(DATA, 8)
    next(first)
    next(second)


class Custom:
    pass


class Thing:
    def state_dict(self):
        return {"count": 3, "inner": Custom()}

    def load_state_dict(self, state):
        pass


def keep_unloadable(s):
    s.keep(net=s.model(nn.Linear(4, 1)), thing=Thing())
    for _ in s.batches(DATA, 8):
        pass


def dataloader_given(s):
    s.keep(net=s.model(nn.Linear(4, 1)))
    sampler = torch.utils.data.RandomSampler(DATA, replacement=True, num_samples=64)
    for _ in s.batches(torch.utils.data.DataLoader(DATA, batch_size=8, sampler=sampler, num_workers=2), 8):
        pass


CASES = {
    "amp_without_backward": (plain_step, ("train.amp=fp16",)),
    "accum_without_micro_batches": (plain_step, ("train.grad_accum=4",)),
    "lr_set": (lambda s: None, ("train.lr=0.1",)),
    "micro_batches_indivisible": (micro_batches_indivisible, ("train.grad_accum=3",)),
    "batches_before_keep": (batches_before_keep, ()),
    "batches_of_another_dataset": (batches_of_another_dataset, ("train.max_steps=null", "train.epochs=2")),
    "model_after_training_started": (model_after_training_started, ()),
    "keep_after_training_started": (keep_after_training_started, ()),
    "keep_without_state_dict": (keep_without_state_dict, ()),
    "model_of_a_wrapped_module": (model_of_a_wrapped_module, ()),
    "log_of_a_vector": (log_of_a_vector, ()),
    "stream_without_max_steps": (stream_without_max_steps, ("train.max_steps=null",)),
    "keep_a_reserved_name": (keep_a_reserved_name, ()),
    "grad_clip_set": (lambda s: None, ("train.grad_clip=1.0",)),
    "nested_batches": (nested_batches, ()),
    "empty_stream": (empty_stream, ()),
    "batches_side_by_side": (batches_side_by_side, ()),
    "keep_unloadable": (keep_unloadable, ()),
    "dataloader_given": (dataloader_given, ()),
}
results = {}
for name, (body, extra) in CASES.items():
    try:
        with session(name, "train.max_steps=2", *extra) as s:
            body(s)
        results[name] = None
    except (Exception, SystemExit) as exc:
        results[name] = [type(exc).__name__, str(exc)]
with session("kept", "train.max_steps=2") as s:  # then resumes that keep other names
    train_two_kept(s)
for name, body in (("resume_unexpected_name", resume_unexpected_name), ("resume_missing_name", resume_missing_name)):
    try:
        with session("kept", "train.max_steps=4") as s:
            body(s)
        results[name] = None
    except Exception as exc:
        results[name] = [type(exc).__name__, str(exc)]
results["keep_unloadable_saved"] = sorted(path.name for path in (base / "keep_unloadable").rglob("step-*"))

# A script that builds its dataset anew each epoch (examples/word_lm_tbptt.py): the feed before is let go, and
# its loader's workers shut down (the loader processes alive after each epoch's s.batches).
import multiprocessing  # noqa: E402

children = []
with session("feeds", "train.epochs=4", "data.num_workers=1") as s:
    net = s.model(nn.Linear(4, 1))
    s.keep(net=net)
    for _epoch in s.epochs():
        for _ in s.batches(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), 8):
            pass
        children.append(len(multiprocessing.active_children()))
results["loader_processes_by_epoch"] = children
results["loader_processes_at_end"] = len(multiprocessing.active_children())
Path(out).write_text(json.dumps(results))
