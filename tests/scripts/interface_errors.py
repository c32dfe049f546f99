"""Build and train each named task of tests/tasks/own_step_tasks.py in one process (a world of 1), and write
what each run raised as JSON: ``{case: [error type, message] or null}``.

Usage: ``interface_errors.py OUT CASE...``; a case is a task name, optionally ``+key=value`` overrides.
"""

import json
import os
import sys

from service.config import load_config
from service.loop.runtime import Runtime
from service.loop.train import build_job, train
from service.state.preemption import Preemption
from service.world.env import detect_world

out, names = sys.argv[1], sys.argv[2:]
world = detect_world(os.environ)
results: dict[str, list[str] | None] = {}
for index, case in enumerate(names):
    name, *overrides = case.split("+")
    run_dir = os.path.join(os.path.dirname(out), f"{index}-{name}")
    os.makedirs(run_dir, exist_ok=True)
    config = load_config(
        None,
        [
            f"task=own_step_tasks:{name}",
            f"run_dir={run_dir}",
            "train.max_steps=2",
            "train.batch_size=4",
            "train.progress_bar=false",
            "metrics.tensorboard=false",
            "checkpoint.every_steps=0",
            "checkpoint.resume=never",
            *overrides,
        ],
    )
    preemption = Preemption()
    try:
        with Runtime.opened(config, world, preemption) as runtime:
            train(build_job(runtime))
        results[case] = None
    except Exception as exc:  # what the user would see
        results[case] = [type(exc).__name__, str(exc)]
    finally:
        preemption.close()
with open(out, "w") as file:
    json.dump(results, file)
