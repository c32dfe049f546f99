"""A session script of the tools (issue 35.3) under torchrun: ``s.steps(n)`` with a kept numpy Generator drawing
each step's data, ``s.micro_batches`` (``train.grad_accum``), ``s.autocast``/``s.backward``/``s.step``
(``train.amp``), then an evaluation with ``s.eval_batches``, ``s.mean``, ``s.sum``, ``s.gather`` and an ``s.log``
outside a step; ``s.main_first``, ``s.print``, ``s.global_step``. Each rank writes what it saw to ``OUT.RANK.json``.

Usage: ``session_tools_run.py OUT STEPS DELAY [--set KEY=VALUE ...]`` (DELAY: seconds slept a step).
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import service

with service.Session() as s:
    out, steps, delay = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])  # the session took --set off argv
    s.print(f"tools: starting at step {s.global_step}")
    with s.main_first():  # rank 0 makes the "cache", the others find it made
        cache = out.with_suffix(".cache")
        if not cache.exists():
            cache.write_text(str(s.rank))
    torch.manual_seed(0)
    net = s.model(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.0005, momentum=0.9)
    rng = np.random.default_rng(7)  # the script's own RNG: the same stream on every rank, kept
    s.keep(net=net, opt=opt, data_rng=rng)
    started_at, indices = s.global_step, []
    for i in s.steps(steps):
        indices.append(i)
        rows = torch.from_numpy(rng.standard_normal((24, 5)).astype(np.float32))
        mine = (rows[s.rank :: s.world_size, :4], rows[s.rank :: s.world_size, 4:])
        for x, y in s.micro_batches(mine):
            with s.autocast():
                loss = nn.functional.mse_loss(net(x).float(), y) * 64
            s.backward(loss)
        s.step(opt)
        opt.zero_grad(set_to_none=True)
        s.log(loss=loss.detach())
        time.sleep(delay)

    samples = [(torch.tensor([float(index)]), torch.tensor(index % 7)) for index in range(101)]
    total, count, values = 0.0, 0, []
    net.eval()
    with torch.no_grad():
        for value, _ in s.eval_batches(samples, 8):
            total += float(value.sum())
            count += len(value)
            values.append(value.reshape(-1))
    mean = s.mean(total / max(count, 1), weight=count)
    s.log(eval_mean=mean)  # outside a step: the evaluation's line at this step
    result = {
        "rank": s.rank,
        "started_at": started_at,
        "global_step": s.global_step,
        "indices": indices,
        "mean": mean,
        "count": s.sum(count),
        "sum_tensor": s.sum(torch.tensor([total, float(count)])).tolist(),
        "gathered": s.gather(torch.cat(values)).tolist(),
        "cache": cache.read_text(),
        "weights": [p.detach().reshape(-1).tolist() for p in s.unwrap(net).parameters()],
        "log_level": s.log_level,
    }
    Path(f"{out}.{s.rank}.json").write_text(json.dumps(result))
