"""The gradient all-reduce's timing, three ways, in the same processes: DDP's built-in all-reduce (no timing), the
service's comm hook (``AllreduceTimer``) and DDP's own C++ timers read at every step (sample rate 1,
``logger._get_ddp_logging_data()``: ``backward_comm_time_start``/``_end``). ``Linear(1, 1)`` steps, the three in
turn, the order flipped every round; main-thread and process CPU a step over the built-in's (rank 0).

    torchrun --standalone --nproc_per_node=2 bench/commtiming_ab.py [STEPS 3000] [ROUNDS 6]

docs/resume.md ("Under the config's own defaults"): why the hook stays.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's service


def main() -> None:
    import torch
    import torch.distributed as dist

    from service.telemetry.commtiming import AllreduceTimer

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make() -> Any:
        torch.manual_seed(0)
        return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))

    x, y = torch.randn(1, 1), torch.randn(1, 1)
    models = {"builtin": make(), "hook": make(), "ddp timers": make()}
    timer = AllreduceTimer()
    models["hook"].register_comm_hook(None, timer.hook)
    models["ddp timers"]._set_ddp_runtime_logging_sample_rate(1)
    logger = models["ddp timers"].logger
    last: list[Any] = [None]
    spans: list[float | None] = []

    def read() -> None:
        logger.set_runtime_stats_and_log()  # this step's stats now (DDP records them at the next forward)
        ints = logger._get_ddp_logging_data().ints_map
        if ints.get("iteration") != last[0]:
            last[0] = ints.get("iteration")
            spans.append((ints["backward_comm_time_end"] - ints["backward_comm_time_start"]) / 1e9)

    takes = {"builtin": lambda: None, "hook": lambda: spans.append(timer.take()), "ddp timers": read}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01) for name, model in models.items()}

    def run(name: str) -> tuple[float, float]:
        model, optimizer, take = models[name], optimizers[name], takes[name]
        dist.barrier()
        thread, process = time.thread_time(), time.process_time()
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            take()
        return (time.thread_time() - thread) / steps * 1e6, (time.process_time() - process) / steps * 1e6

    results: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    names = list(models)
    for round_ in range(rounds + 1):  # the first round warms up
        for name in names if round_ % 2 == 0 else names[::-1]:
            got = run(name)
            if round_:
                results[name].append(got)
    if rank == 0:
        print(f"{steps} steps x {rounds} rounds, world {dist.get_world_size()}: CPU µs a step (rank 0)")
        for name in names:
            cells = []
            for index, what in enumerate(("main", "process")):
                own = statistics.median(row[index] for row in results[name])
                over = [a[index] - b[index] for a, b in zip(results[name], results["builtin"], strict=True)]
                cells.append(f"{what} {own:6.1f}, over builtin {statistics.median(over):+6.1f} "
                             f"({min(over):+.1f}..{max(over):+.1f})")  # fmt: skip
            print(f"  {name:<12}" + "   ".join(cells))
        print("  the last spans (ms):", [round(span * 1e3, 3) for span in spans[-5:] if span is not None])
    models.clear()  # the DDP models go before the process group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
