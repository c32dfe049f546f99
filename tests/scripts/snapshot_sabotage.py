"""A session whose snapshots fail from step AT on, in one of the ways a node can make them fail; training goes on.
Usage (under torchrun): ``snapshot_sabotage.py --set ... CASE AT``.

The sabotage is rank 0's (the writer of its node's snapshots), in the body of step AT:

- ``unpicklable``: a kept object's state holds a lambda from step AT until the last step, which is plain again;
- ``efbig0``, ``efbig_mid``: this process may write no byte (``efbig0``), or 64 KiB (``efbig_mid``: a snapshot of
  6 MiB fails midway, inside torch's zip writer) into any file (RLIMIT_FSIZE, standing in for a full /dev/shm); the
  limit is lifted in the last step, before the final disk checkpoint;
- ``vanish``: the root of the snapshot areas is removed;
- ``readonly``: the tmpfs that holds it (``checkpoint.snapshot_dir``, a mount of its own) is remounted read-only;
- ``none``, ``squatted``: nothing (the reference run, with ``checkpoint.snapshot_every=0``; a root made by another
  user before the job).

At the end each rank prints the files it holds open under ``checkpoint.snapshot_dir``: ``open under DIR: [...]``.
"""

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import service

CASE, AT = sys.argv[-2], int(sys.argv[-1])
STEPS = 8


class Counter:
    """Kept beside the model: its state is a plain number, but a lambda while ``CASE`` is unpicklable."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        if CASE == "unpicklable" and AT <= self.steps < STEPS:
            return {"steps": self.steps, "scale": lambda x: x}
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def sabotage(snapshot_dir: str) -> None:
    root = Path(snapshot_dir) / f"ddp-service-{os.getuid()}"
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    if CASE in ("efbig0", "efbig_mid"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (0 if CASE == "efbig0" else 64 * 1024, hard))
    elif CASE == "vanish":
        for _ in range(200):  # the background writer may add a file while rmtree walks: again until it is gone
            shutil.rmtree(root, ignore_errors=True)
            if not root.exists():
                break
            time.sleep(0.01)
        else:
            raise SystemExit(f"could not remove {root}")
    elif CASE == "readonly":
        for _ in range(200):  # EBUSY while a file is open for writing there: the last snapshot, in flight
            if subprocess.run(["mount", "-o", "remount,ro", snapshot_dir], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"could not remount {snapshot_dir} read-only")
    elif CASE not in ("unpicklable", "none", "squatted"):
        raise SystemExit(f"no such case: {CASE}")


def open_under(directory: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing (the listing's own descriptor)
        if target.startswith(directory):
            found.append(target)
    return found


torch.manual_seed(0)
data = TensorDataset(torch.randn(STEPS * 8, 1024), torch.randn(STEPS * 8, 1))
with service.Session() as s:
    model = s.model(nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    counter = Counter()
    s.keep(model=model, optimizer=optimizer, counter=counter)
    for x, y in s.batches(data, 8):
        counter.steps += 1
        if counter.steps == AT and s.local_rank == 0:
            sabotage(s.config.checkpoint.snapshot_dir)
        if counter.steps == STEPS and CASE.startswith("efbig"):
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
snapshot_dir = s.config.checkpoint.snapshot_dir
print(f"rank {s.rank}: open under {snapshot_dir}: {open_under(snapshot_dir)}", flush=True)
