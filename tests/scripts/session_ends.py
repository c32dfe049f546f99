"""A session's loop that ends as ``SESSION_END`` says (tests/test_session_e2e.py runs it at 2 processes under
torchrun): ``FORM:HOW``, FORM ``with`` (``with service.Session() as s``) or ``start`` (``s =
service.Session().start()``, module level); HOW, after step 3's body: ``break`` (every rank), ``break-rank1``
(rank 1 only), ``exit-N`` (``sys.exit(N)``); or ``rename`` (keeps another name than the run it resumes); or
``epochs-N``: the script's own count, ``for epoch in s.epochs(N): for x, y in s.batches(...)``, printing each
epoch's number and the step it starts at."""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import service

form, how = os.environ["SESSION_END"].split(":")
torch.manual_seed(0)
DATA = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def train(s: service.Session) -> None:
    net = s.model(nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    s.keep(**{"other" if how == "rename" else "net": net}, opt=opt)
    s.keep_rank(seen=service.Carry(0))  # each rank's own state: gathered from every rank at each save
    if how.startswith("epochs-"):
        for epoch in s.epochs(int(how.removeprefix("epochs-"))):
            print(f"rank {s.rank}: epoch {epoch} at step {s.global_step}", flush=True)
            for x, y in s.batches(DATA, 4):
                opt.zero_grad()
                loss = nn.functional.mse_loss(net(x), y)
                loss.backward()
                opt.step()
                s.log(loss=loss)
        return
    for step, (x, y) in enumerate(s.batches(DATA, 4), s.epoch_step + 1):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        s.log(loss=loss)
        if step >= 3 and how == "break" or (how == "break-rank1" and s.rank == 1 and step >= 3):
            print(f"rank {s.rank} leaves its loop at {time.time():.3f}", flush=True)
            break
        if step >= 3 and how.startswith("exit-"):
            sys.exit(int(how.removeprefix("exit-")))
    print(f"rank {s.rank}: after the loop", flush=True)


if form == "start":
    session = service.Session().start()
    train(session)
else:
    with service.Session() as session:
        train(session)
