"""The service's loop with the Prometheus exporter on against the same loop with it off.

Same model (the shapes UNet, SyncBatchNorm on as by default), data, batch and
2 gloo processes. Each torchrun run builds two jobs in the same processes, one
with metrics off and one with them on, and alternates them epoch by epoch (the
order flips each epoch), so drift on the machine hits both alike; the ratio is
the median over the paired epochs. With metrics on, every rank serves its
registry (``metrics.port=auto``), times its steps, data waits, DDP all-reduce
(the comm hook), buffer broadcast and SyncBatchNorm all-reduces, and a thread
in each rank scrapes its own endpoint every ``--scrape-every`` seconds, as
Prometheus would.
Both modes log every 10 steps (the loss is read from the device there in both).
Prints the median step time of each and the throughput ratio on / off (target >= 0.99).
``--ledger``: the goodput ledger (``metrics.goodput``, a record every second) on against off instead, the
exporter off in both; otherwise the ledger is off in both.

    python bench/metrics_overhead.py [--rounds 3] [--epochs 8] [--batch 8] [--scrape-every 1] [--ledger]

BENCH_NO_ALLREDUCE_HOOK=1 runs with metrics.allreduce_timing=false, to see the collective timers' share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one
TRAIN_SIZE = 512


def worker(epochs: int, batch: int, scrape_every: float, out: Path, ledger: bool = False) -> None:
    """Runs under torchrun: two jobs in the same processes and process group, metrics off and on, alternating
    epoch by epoch (``paired``). Writes rank 0's seconds per step of each epoch of each job."""
    from paired import runtimes

    with runtimes({mode: _overrides(mode, batch, epochs, ledger) for mode in ("off", "on")}) as opened:
        times = _time_epochs(opened, epochs, scrape_every)
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(times))


def _overrides(mode: str, batch: int, epochs: int, ledger: bool = False) -> list[str]:
    port = "auto" if mode == "on" and not ledger else 0
    return [
        f"metrics.goodput={ledger and mode == 'on'}", "metrics.goodput_every_seconds=1",
        f"train.batch_size={batch}", f"train.epochs={epochs}", f"task_options.train_size={TRAIN_SIZE}",
        "train.progress_bar=false", "train.log_every=10",
        "metrics.tensorboard=false", f"metrics.port={port}",
        "checkpoint.every_steps=0", "checkpoint.resume=never",
        f"metrics.allreduce_timing={os.environ.get('BENCH_NO_ALLREDUCE_HOOK') != '1'}",
    ]  # fmt: skip


def _time_epochs(runtimes: dict, epochs: int, scrape_every: float) -> dict[str, list[float]]:
    """Seconds per step of each epoch of each job (``paired.alternate``), a thread scraping the metrics meanwhile."""
    from paired import alternate

    from service.telemetry.prometheus import PrometheusSink

    ports = [sink.port for sink in runtimes["on"].roles.sink.sinks if isinstance(sink, PrometheusSink)]
    if [sink for sink in runtimes["off"].roles.sink.sinks if isinstance(sink, PrometheusSink)]:
        raise SystemExit("The job with metrics off serves Prometheus metrics: the comparison would be void.")
    stop = threading.Event()
    scrapes = [0]

    def scrape() -> None:
        while not stop.wait(scrape_every):
            for port in ports:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                scrapes[0] += 1

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    timed = alternate(runtimes, epochs)
    stop.set()
    scraper.join()
    if runtimes["on"].world.rank == 0:
        print(f"scraped {scrapes[0]} times", file=sys.stderr)
    return {mode: [e["seconds"] / max(e["steps"], 1) for e in rows] for mode, rows in timed.items()}


def run(epochs: int, batch: int, scrape_every: float, ledger: bool = False) -> dict[str, list[float]]:
    from paired import launch

    args = ["--epochs", str(epochs), "--batch", str(batch), "--scrape-every", str(scrape_every),
            *(["--ledger"] if ledger else [])]  # fmt: skip
    times = launch(__file__, 2, args)
    return {mode: values[1:] for mode, values in times.items()}  # the first epoch warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--scrape-every", type=float, default=1.0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ledger", action="store_true", help="the goodput ledger on against off")
    args = parser.parse_args()
    if args.worker:
        worker(args.epochs, args.batch, args.scrape_every, args.out, args.ledger)
        return
    samples: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []  # epoch by epoch, each pair run back to back, so drift on the machine cancels out
    for round_ in range(args.rounds):
        times = run(args.epochs, args.batch, args.scrape_every, args.ledger)
        for mode in samples:
            samples[mode] += times[mode]
        ratios += [off / on for off, on in zip(times["off"], times["on"], strict=True)]
        medians = ", ".join(f"metrics {m} {statistics.median(v) * 1e3:.2f} ms/step" for m, v in times.items())
        print(f"round {round_ + 1}/{args.rounds}: {medians}", flush=True)
    off_ms = statistics.median(samples["off"]) * 1e3
    on_ms = statistics.median(samples["on"]) * 1e3
    what = "goodput ledger" if args.ledger else "metrics"
    print(f"\n{what.split()[-1]:<10}{'median ms/step':>16}{'epochs timed':>14}")
    print(f"{'off':<10}{off_ms:>16.2f}{len(samples['off']):>14}")
    print(f"{'on':<10}{on_ms:>16.2f}{len(samples['on']):>14}")
    print(f"\nthroughput ratio {what} on/off: {statistics.median(ratios):.3f} (median of {len(ratios)} paired "
          f"epochs; pooled medians {off_ms / on_ms:.3f}; target >= 0.99)")  # fmt: skip


if __name__ == "__main__":
    main()
