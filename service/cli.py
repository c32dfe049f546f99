"""``ddp-service`` / ``python -m service``: train, validate, env, launch, doctor, export, goodput.

A thin entrypoint: parse, build, train, close in ``finally``. ``@record``
makes torchrun report the failing rank's traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from service import early
from service.config import ConfigError, JobConfig, config_as_yaml, load_config
from service.ops import export as weights_export
from service.ops import goodput as goodput_report
from service.rendezvous import admin as rdzv_admin
from service.state.preemption import Preemption
from service.world.env import EnvError, WorldInfo, detect_world
from service.world.preflight import check_against_world

log = logging.getLogger("service")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddp-service", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "run a training job"), ("validate", "print the resolved config")):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", nargs="?", help="job YAML; omitted: the embedded defaults")
        command.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                             help="override one key, e.g. --set train.lr=0.1 (repeatable)")  # fmt: skip
    commands.add_parser("env", help="print the launcher environment this process detected, as JSON")
    # launch and doctor parse their own options (torchrun's among them): service/ops/launcher.py, service/ops/doctor.py
    commands.add_parser("launch", add_help=False, help="run the job under torchrun's agent, in one command")
    commands.add_parser("doctor", add_help=False, help="check this machine and launcher before a job")
    rdzv_admin.add_parser(commands)  # rdzv list|show|retire: service/rendezvous/admin.py
    weights_export.add_parser(commands)  # export RUN_DIR OUT: service/ops/export.py
    goodput_report.add_parser(commands)  # goodput RUN_DIR: service/ops/goodput.py
    return parser


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
         handlers_until_exit: bool = False) -> int:  # fmt: skip
    """The command; ``handlers_until_exit`` (``python -m service``, which leaves right after): train's signal
    handlers stay installed after it returns, so a signal in the last moment before the exit (the agent's SIGTERM
    once a peer exited 75) only sets a flag and cannot kill the process with a signal's exit status."""
    parser = _parser()
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit:
        early.release()
        raise
    if args.command not in ("train", "launch"):
        early.release()  # those two release once their own handlers are in (a signal then reaches them)
    env = os.environ if env is None else env
    if args.command == "launch":
        from service.ops.launcher import main as launch

        return launch(rest, env)  # it releases the held signals once its own handlers are in
    if args.command == "doctor":
        from service.ops.doctor import main as doctor

        return doctor(rest, env)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "rdzv":
        return rdzv_admin.run(args)
    if args.command == "export":
        return weights_export.run(args)
    if args.command == "goodput":
        return goodput_report.run(args)
    # First thing for train: a preemption during start-up (torch loading, the lock, the rendezvous, the resume)
    # is kept until the loop's first agreement, instead of killing the process before it writes any summary.
    preemption = Preemption() if args.command == "train" else None
    early.release()  # a signal held since the first line goes to train's handler now (or has its default effect)
    try:
        return _command(args, env, preemption)
    finally:
        if preemption is not None and not handlers_until_exit:
            preemption.close()


def _command(args: argparse.Namespace, env: Mapping[str, str], preemption: Preemption | None) -> int:
    try:
        if args.command == "env":
            print(detect_world(env).to_json())
            return 0
        config = load_config(args.config, args.overrides)
        if preemption is None:  # validate: only train installs the handlers
            print(config_as_yaml(config), end="")
            return 0
        world = detect_world(env)
        check_against_world(config, world)
    except (ConfigError, EnvError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return train_command(config, world, preemption)


def _record(function):  # noqa: ANN001, ANN202
    """torch's ``@record``, imported lazily so ``validate`` and ``env`` do not load torch."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(function)


def train_command(config: JobConfig, world: WorldInfo, preemption: Preemption) -> int:
    from service.telemetry.logs import configure_logging, log_level

    configure_logging(world.rank, log_level(world.rank, config.logging.all_ranks))
    terminal = sys.stderr.isatty()  # decided once: a progress bar on a terminal, plain lines elsewhere
    return _record(_train)(config, world, preemption, terminal)


def _train(config: JobConfig, world: WorldInfo, preemption: Preemption, terminal: bool) -> int:
    from service.state.best import BestMetricError
    from service.state.consistency import ConfigMismatchError
    from service.state.resume import ResumeError
    from service.state.weights import WeightsError

    try:
        return _train_in_group(config, world, preemption, terminal)
    except (ConfigMismatchError, ResumeError, WeightsError, BestMetricError) as exc:  # at start, every rank: exit 2
        log.error("%s", exc)
        return exc.exit_code


def _train_in_group(config: JobConfig, world: WorldInfo, preemption: Preemption, terminal: bool) -> int:
    from service.loop.runtime import Runtime
    from service.loop.train import run_task
    from service.state.preemption import EXIT_COMPLETED, EXIT_FAILED, EXIT_PREEMPTED

    with Runtime.opened(config, world, preemption, terminal) as runtime:
        summary = run_task(runtime)
    if summary["status"] == "lock_lost":
        log.error("stopped at step %d without a checkpoint: %s", summary["global_step"],
                  summary["error"] or "rank 0 lost the run_dir lock; another job may own run_dir now")  # fmt: skip
        return EXIT_FAILED
    if summary["status"] == "preempted":
        log.warning("preempted: stopped at step %d after saving its checkpoint; run the same command to resume",
                    summary["global_step"])  # fmt: skip
        return EXIT_PREEMPTED
    log.info("done: step %d, %s %.4f, %.1f samples/s", summary["global_step"],
             summary["eval_metric"]["name"], summary["eval_metric"]["value"] or 0.0,
             summary["samples_per_second"] or 0.0)  # fmt: skip
    return EXIT_COMPLETED


if __name__ == "__main__":
    sys.exit(main())
