"""A session over a stream, written at module level (the session and its loaders live until the interpreter's end):
each rank appends one JSON line per step to ``OUT/rank{r}.jsonl`` (the sample ids it trained, the time).

Usage (under torchrun, with ``--set`` for the config): ``session_streams.py KIND OUT [DATA]``; KIND is
``hf`` (a Hugging Face ``datasets`` stream of DATA/*.jsonl, an ``id`` per line), ``endless`` (a torch
``IterableDataset`` with state, without end), ``unloadable`` (the same, whose state a resume could not load) or
``oneshot`` (each rank its own generator, read once: rank 0 has
four times rank 1's batches). ``STEP_SLEEP`` (seconds) slows each step.
"""

import glob
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import IterableDataset

import service


class Endless(IterableDataset):
    """Ids 0, 1, 2, ... without end; ``state_dict`` says how far its iterator went."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        while True:
            self.position += 1
            yield {"id": torch.tensor(self.position - 1)}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


class Position:
    """Not a plain value: a checkpoint's loader (weights_only) could not load it back."""

    def __init__(self, at: int) -> None:
        self.at = at


class Unloadable(Endless):
    def state_dict(self):
        return {"position": Position(self.position)}


class OneShot(IterableDataset):
    """A generator made once: a second pass finds it used up."""

    def __init__(self, count: int) -> None:
        self.items = ({"id": torch.tensor(index)} for index in range(count))

    def __iter__(self):
        return self.items


with service.Session() as s:
    kind, out = sys.argv[1], Path(sys.argv[2])
    shard = True
    if kind == "hf":
        from datasets import load_dataset

        files = sorted(glob.glob(os.path.join(sys.argv[3], "*.jsonl")))
        data = load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")
    elif kind == "endless":
        data = Endless()
    elif kind == "unloadable":
        data = Unloadable()
    else:
        data, shard = OneShot(4 * 4 * (4 if s.rank == 0 else 1)), False
    torch.manual_seed(0)
    model = s.model(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    s.keep(model=model, optimizer=optimizer)
    with open(out / f"rank{s.rank}.jsonl", "a") as trace:
        for batch in s.batches(data, batch_size=4, shard=shard):
            ids = batch["id"]
            loss = model(ids.float().unsqueeze(1) / 100).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            trace.write(json.dumps({"ids": ids.tolist(), "at": time.time()}) + "\n")
            trace.flush()
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))  # a preemption test's time to signal mid-run
