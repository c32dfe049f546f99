"""``service.Session``: the service for a script that keeps its own training loop.

::

    with service.Session("job.yaml", overrides=["train.max_steps=200"]) as s:
        netG, netD = s.model(Generator()), s.model(Discriminator())
        optG, optD = Adam(netG.parameters()), Adam(netD.parameters())
        s.keep(netG=netG, netD=netD, optG=optG, optD=optD)    # restored here on a resume
        for batch in s.batches(dataset, batch_size=64):        # one optimizer step's batch, on the device
            ...                                                # the script's own step
            s.log(loss_D=errD, loss_G=errG)

The session starts as ``ddp-service train`` does (the preemption handlers first, the launcher's environment, the
run_dir lock, the process group, the config and resume agreements, metrics, the goodput ledger, snapshots, the
hang watchdog) on the same :class:`~service.loop.runtime.Runtime` as the built-in task loop, whose step boundary
(:mod:`service.loop.stepping`) works between two batches. A preemption ends ``s.batches`` after the checkpoint of
its step by raising :class:`Preempted` (a ``SystemExit`` of 75): the rest of the ``with`` block does not run,
``summary.json`` says ``preempted``, and the process exits 75. An exception writes ``status: failed`` and goes on.

How a loop ends, in both forms: running out, a ``break`` (or ``return``) or ``sys.exit(0)`` is ``completed`` at
that step, with its checkpoint (the step whose body broke out counts), and a rerun trains nothing; every rank
must leave at the same step: the ranks agree on it through the store (:func:`~service.loop.stepping.leave`), and
a rank that left alone ends the job within seconds, ``failed``, naming itself and the fix (``left_loop`` in
``summary.json``). ``sys.exit(N)`` with another code is ``failed`` with ``exit_code: N``. Bad input found at
``s.keep`` or ``s.batches`` (:class:`~service.config.errors.Refusal`: a resume whose kept names differ, a stream saved
at another world size) exits 2 on every rank with its message and no traceback, and writes nothing.

Without ``with`` (a module-level script ported with few changed lines): ``s = service.Session().start()``; the
session then ends when the interpreter does, or at an uncaught exception (failed). Python runs that end (its
``atexit``) after the exit status is decided and hides it, so the session reads it where it can: ``sys.exit(N)``
(the session wraps ``sys.exit`` until it closes), a refusal it raised, an uncaught exception. A bare ``raise
SystemExit(N)`` (or ``exit(N)``) that passes no session call is not seen there: the run then reads as completed;
use ``sys.exit`` or the ``with`` form.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

from service import early
from service.config import ConfigError, JobConfig, apply_overrides, build_config, load_config
from service.config.errors import Refusal
from service.loop.session_tools import SessionTools
from service.state.preemption import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_PREEMPTED,
    Preemption,
    exit_code_of,
    ignore_stop_signals,
)

log = logging.getLogger("service.loop.train")


class SessionError(RuntimeError, Refusal):
    """A session used out of order (a call before ``start``, a second ``s.batches`` loop inside one); the message
    names the call and the fix; uncaught, the process exits 2 with no traceback."""


class Stopped(SystemExit):
    """``s.batches`` ended the run before its last step; the process exits with :attr:`code`."""


class Preempted(Stopped):
    """A preemption (SIGTERM, SIGUSR1) stopped every rank at one step, after its checkpoint: exit 75, rerun to
    resume. Catch it to run something first; re-raise it to keep the exit code."""

    def __init__(self) -> None:
        super().__init__(EXIT_PREEMPTED)


class LockLost(Stopped):
    """rank 0 lost the run_dir lock (another job may own it now): every rank stopped, nothing more saved; exit 1."""

    def __init__(self) -> None:
        super().__init__(EXIT_FAILED)


class LeftAlone(Stopped):
    """This rank left its loop at a step where other ranks went on (a ``break`` on some ranks only): nothing more
    is saved, and the job ends; exit 1. The message names the ranks and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_FAILED)
        self.message = message

    def __str__(self) -> str:
        return self.message


def split_argv(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
    """``--config FILE`` and ``--set KEY=VALUE`` (either as ``--opt=value``) out of a script's arguments: (the file,
    the overrides, the script's own arguments, in their order)."""
    path: str | None = None
    overrides: list[str] = []
    rest: list[str] = []
    items = iter(argv)
    for item in items:
        name, sep, value = item.partition("=")
        if name in ("--config", "--set"):
            if not sep:
                value = next(items, None)  # type: ignore[assignment]
                if value is None:
                    example = "job.yaml" if name == "--config" else "train.lr=0.1"
                    raise ConfigError([f"{name} needs a value, e.g. {name} {example}"], "The command line")
            if name == "--config":
                path = value
            else:
                overrides.append(value)
        else:
            rest.append(item)
    return path, overrides, rest


class Session(SessionTools):
    """The service around a script's own loop (module docstring); its tools (precision, accumulation, evaluation,
    coordination, ``s.steps``) in :mod:`service.loop.session_tools`. Public API: add, never rename."""

    def __init__(self, config: str | Path | JobConfig | None = None, overrides: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self._config_arg, self._overrides, self._env = config, list(overrides), env
        self._runtime: Any = None
        self._stack: contextlib.ExitStack | None = None
        self._preemption: Preemption | None = None
        self._feeds: dict[tuple[Any, ...], Any] = {}
        self._epoch: int | None = None
        self._last_feed: Any = None  # the feed of the latest s.batches call (s.epoch_step reads its batch)
        self._running = False  # an s.batches loop is under way (a second one is refused)
        self._closed = False
        self._with = False
        self._ending: BaseException | None = None  # without `with`: a sys.exit or a refusal seen on the way out
        self._sys_exit: Callable[..., Any] | None = None
        self.rank = self.local_rank = 0
        self.world_size = 1
        self.device: Any = None
        self.config: JobConfig | None = None

    # ------------------------------------------------------------------ start and end
    def __enter__(self) -> Session:
        self._with = True
        return self.start()

    def start(self) -> Session:
        """Start the session (``with`` does): the preemption handlers first, then the world, the lock, the group."""
        if self._runtime is not None:
            return self
        self._preemption = Preemption()  # first thing: a signal during start-up is kept until the first agreement
        early.release()  # a signal held since the program's first line (launch's workers) reaches it now
        try:
            self._open()
        except BaseException:
            self._preemption.close()
            raise
        if not self._with:
            atexit.register(self._at_exit)
            self._watch_exit()
            previous = sys.excepthook

            def on_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
                self.close(exc)
                previous(kind, exc, tb)

            sys.excepthook = on_uncaught
        return self

    def _open(self) -> None:
        from service.loop.runtime import Runtime
        from service.state.consistency import ConfigMismatchError
        from service.state.resume import ResumeError
        from service.telemetry.logs import configure_logging, log_level
        from service.world.env import EnvError, detect_world
        from service.world.preflight import check_against_world

        env = os.environ if self._env is None else self._env
        try:
            config = self._load_config()
            world = detect_world(env)
            check_against_world(config, world)
            refuse_unused(config)
        except (ConfigError, EnvError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        configure_logging(world.rank, log_level(world.rank, config.logging.all_ranks))
        label = f"session:{Path(sys.argv[0]).name or 'python'}"
        self._stack = contextlib.ExitStack()
        try:
            preemption = self._preemption or Preemption()
            self._runtime = self._stack.enter_context(Runtime.opened(config, world, preemption, sys.stderr.isatty(),
                                                                     label))  # fmt: skip
        except (ConfigMismatchError, ResumeError) as exc:  # at start, on every rank: no traceback; exit 2
            self._stack.close()
            log.error("%s", exc)
            raise SystemExit(exc.exit_code) from None
        self.config, self.rank, self.world_size = config, world.rank, world.world_size
        self.local_rank, self.device = world.local_rank, self._runtime.device
        self._tools_open()

    def _load_config(self) -> JobConfig:
        """The config given, the overrides given, then the command line's --config and --set (which win); those two
        are taken off ``sys.argv``, so the script's own parser sees only its own arguments."""
        path, given_overrides, rest = split_argv(sys.argv[1:])
        sys.argv[1:] = rest
        given = path if path is not None else self._config_arg
        overrides = [*self._overrides, *given_overrides]
        if isinstance(given, JobConfig):
            if not overrides:
                return given
            data = apply_overrides(given.model_dump(mode="json", by_alias=True), overrides)
            return build_config(data, "The session's config", {o.partition("=")[0]: o for o in overrides})
        return load_config(given, overrides)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:  # fmt: skip
        self.close(exc)
        return False

    def close(self, exc: BaseException | None = None) -> None:
        """End the session: the last checkpoint and ``summary.json`` (``completed``, also for ``sys.exit(0)``;
        ``failed`` for ``exc``, with its exit code), then the group and the lock. Raises :class:`LeftAlone` when this
        rank left its loop at a step where others went on."""
        if self._closed or self._runtime is None:
            return
        self._closed = True
        rt = self._runtime
        alone: LeftAlone | None = None
        try:
            if isinstance(exc, Stopped):
                pass  # s.batches wrote the summary of the stop before raising it
            elif exc is None or exit_code_of(exc) == EXIT_COMPLETED:  # none, or sys.exit(0)
                alone = self._complete(rt)
            else:
                self._fail(rt, exc)
            if rt.summary is not None:  # every rank's own (logging.all_ranks shows them all): replicas agree
                log.info(
                    "done: %s at step %d, model digest %s, %s samples/s",
                    rt.summary["status"],
                    rt.summary["global_step"],
                    rt.summary["model_digest"],
                    rt.summary["samples_per_second"],
                )
        finally:
            self._close_feeds()  # their loader workers would hold the process's exit
            if self._stack is not None:
                self._stack.close()
            if self._preemption is not None and self._with:
                self._preemption.close()
            if isinstance(exc, SystemExit) or alone is not None:  # the process leaves now, with its own status
                ignore_stop_signals()
            if self._sys_exit is not None:
                sys.exit = self._sys_exit
                self._sys_exit = None
        if alone is not None:
            raise alone

    def _complete(self, rt: Any) -> LeftAlone | None:
        """The loop ran out, or a break or sys.exit(0) left it: completed there when every rank left at that step."""
        from service.loop.stepping import leave

        if rt.summary is not None:
            return None
        left = leave(rt)  # a break after a step's body: that step counts, and every rank must have left there
        extra = {"left_loop": left.describe()} if left is not None else None
        if left is not None and not left.every_rank:
            message = left.message()
            log.error("%s", message)
            alone = LeftAlone(message)
            rt.fail(alone, extra, error=message)
            return alone
        rt.finish(rt.stopped or "completed", extra)
        return None

    def _fail(self, rt: Any, exc: BaseException) -> None:
        """``status: failed`` for ``exc``; a peer that left its loop alone (the likely cause) is named first."""
        from service.config.errors import Refusal
        from service.loop.stepping import Left, left_peers

        error, extra = None, None
        peers = {} if isinstance(exc, Refusal) else left_peers(rt)
        if peers:
            left = Left(min(peers.values()), sorted(peers), False, [self.rank])
            error = f"{left.message()} Then this rank failed: {type(exc).__name__}: {exc}"
            extra = {"left_loop": left.describe()}
            log.error("%s", error)
        rt.fail(exc, extra, error=error)
        if not isinstance(exc, SystemExit):
            _record_error(exc)

    def _watch_exit(self) -> None:
        """Without ``with``: ``sys.exit`` notes its code for the session's end at exit, which cannot see it."""
        original = self._sys_exit = sys.exit

        def exit_seen(status: Any = None) -> NoReturn:
            if threading.current_thread() is threading.main_thread():
                self._ending = SystemExit(status)
            original(status)
            raise SystemExit(status)  # not reached: the original raises

        sys.exit = exit_seen

    def _at_exit(self) -> None:
        try:
            self.close(self._ending)
            ignore_stop_signals()  # the interpreter is leaving, with its own status
        except Stopped as stop:  # an exception in an atexit function cannot change the exit status: exit here
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(exit_code_of(stop))

    def _seen(self, exc: BaseException) -> None:
        """A refusal on its way out of a session call: the end at exit (no ``with``) reads it."""
        self._ending = exc

    # ------------------------------------------------------------------ the public calls
    @property
    def _rt(self) -> Any:
        if self._runtime is None:
            raise SessionError("this Session has not started: use `with service.Session(...) as s:` or "
                               "`s = service.Session(...).start()` before its other calls.")  # fmt: skip
        return self._runtime

    def model(self, module: Any) -> Any:
        """``module`` on the device, SyncBatchNorm per ``train.sync_batchnorm``, compiled per ``train.compile``, in
        DDP with the ``ddp.*`` options (its settle step at the first forward). Call it before ``s.batches``."""
        return self._rt.model(module, call="s.model")

    def unwrap(self, model: Any) -> Any:
        """The plain module under the wrappers ``s.model`` put around it."""
        from service.model.parallel import unwrap

        return unwrap(model)

    def keep(self, **objects: Any) -> None:
        """Keep objects with ``state_dict``/``load_state_dict`` (modules, optimizers, schedulers, GradScalers, your
        own) in every checkpoint and snapshot; on a resume each is loaded here, at once. Before ``s.batches``."""
        with self._refusals():
            self._rt.keep(objects, False, "s.keep")

    def keep_rank(self, **objects: Any) -> None:
        """As ``keep``, each rank's own copy (a hidden state, a per-rank stream): back to its own rank at the same
        world size; at another, left as built, with one warning naming them."""
        with self._refusals():
            self._rt.keep(objects, True, "s.keep_rank")

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        from service.config.errors import Refusal

        try:
            yield
        except Refusal as exc:
            self._seen(exc)
            raise

    @property
    def epoch_step(self) -> int:
        """Steps already taken in the current epoch: 0 at its start, the resumed position after a resume.
        ``enumerate(s.batches(...), s.epoch_step)`` numbers a resumed epoch's batches as the uninterrupted run did."""
        rt = self._rt
        feed = rt.feed or self._last_feed
        batch = feed.global_batch if feed is not None else None
        return rt.state.cursor // batch if batch else 0

    def epochs(self) -> Iterator[int]:
        """The epochs left (``train.epochs``, from the one a resume stands in); within one, ``s.batches`` gives that
        epoch's batches only."""
        rt, epochs = self._rt, self._rt.config.train.epochs
        while (
            rt.stopped is None
            and rt.state.epoch < epochs
            and not (rt.total_steps and rt.state.global_step >= rt.total_steps)
        ):
            epoch = self._epoch = rt.state.epoch
            try:
                yield epoch
            finally:
                self._epoch = None
            if rt.state.epoch == epoch:  # the body left its epoch unfinished (a break, or no s.batches)
                return

    def batches(self, dataset: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None,
                shuffle: bool = True, shard: bool = True, drop_last: bool = True) -> Iterator[Any]:  # fmt: skip
        """One optimizer step's batch at a time, on the device (any nesting of tensors). Map-style datasets go
        through the resumable sampler (every sample once per epoch, across resizes); ``shuffle=False`` keeps the
        dataset's order; ``shard=False`` gives each rank its own dataset whole, in order (TBPTT). An iterable
        dataset (a stream) is sharded over the ranks and resumes from its state."""
        with self._refusals():
            self._refuse_second_loop()
            feed = self._feed(dataset, batch_size, collate_fn, shuffle, shard, drop_last)  # s.epoch_step knows it now
        self._last_feed = feed
        return self._batches(feed)

    def _refuse_second_loop(self) -> None:
        if self._running:
            raise SessionError(
                "s.batches(...) was called while another s.batches loop is still running (nested, or two side by "
                "side): both would draw from the one data position of the run, skipping samples and counting "
                "steps twice. Use one s.batches loop at a time; to read a second dataset in the same step, "
                "iterate it yourself inside the loop (e.g. next() on a DataLoader of it)."
            )

    def _batches(self, feed: Any) -> Iterator[Any]:
        from service.data.batches import to_device
        from service.loop.stepping import Hooks, steps

        rt = self._rt
        hooks = Hooks(reported=self._reported, stepped=self._stepped)
        self._refuse_second_loop()  # two made before either ran: the second to start is refused
        self._running = True
        try:
            with self._refusals():  # the resume's checks of the data, at the first step
                for fed in steps(rt, feed, hooks, one_epoch=self._epoch is not None, call="s.batches(...)"):
                    yield to_device(fed.batches[0], rt.device, non_blocking=True)
                    self._ending = None  # the loop went on: a sys.exit the script caught is no end
        finally:
            self._running = False
        if rt.stopped is not None:
            rt.finish(rt.stopped)
            raise Preempted() if rt.stopped == "preempted" else LockLost()

    def _reported(self, report: Any) -> None:
        """``checkpoint.best`` on a script's logged numbers: at each log line, its world means."""
        rt = self._rt
        if rt.config.checkpoint.best is not None:
            rt.gather_own()
            rt.roles.checkpointer.on_eval(rt.state.global_step, report.world_values, rt.checkpoint_state)

    def _feed(self, dataset: Any, batch_size: int, collate_fn: Any, shuffle: bool, shard: bool,
              drop_last: bool) -> Any:  # fmt: skip
        from service.data.dataset_feed import dataset_feed

        key = (id(dataset), batch_size, id(collate_fn), shuffle, shard, drop_last)
        if key not in self._feeds:  # another dataset (one made anew each epoch): the one before is done with
            feed = dataset_feed(
                self._rt,
                dataset,
                batch_size,
                collate_fn,
                shuffle=shuffle,
                shard=shard,
                tail="drop" if drop_last else "keep",
            )
            self._close_feeds()
            self._feeds[key] = feed
        return self._feeds[key]

    def _close_feeds(self) -> None:
        """Shut the cached feeds' loader workers down and let go of them."""
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.close()


def refuse_unused(config: JobConfig) -> None:
    """Config keys a script's own loop cannot honour (it builds and steps its own optimizer), when set: an error naming
    each and what replaces it. ``train.amp``, ``train.grad_accum`` and ``train.nonfinite`` are the session tools'
    (:mod:`service.loop.session_tools`), refused at the first step when none of those tools applied them."""
    train, problems = config.train, []
    if train.grad_clip != "auto":
        problems.append(f"train.grad_clip={train.grad_clip}: the script steps its own optimizer, so clip in its step "
                        "(s.step(optimizer, max_norm=...), or torch.nn.utils.clip_grad_norm_(model.parameters(), "
                        "max_norm) before optimizer.step()) and leave train.grad_clip unset")  # fmt: skip
    if train.lr_schedule != "auto":
        problems.append(
            f"train.lr_schedule={train.lr_schedule}: the script steps its own optimizer, so build its "
            "schedule in the script (and keep it with s.keep) and leave train.lr_schedule unset"
        )
    if config.init_from is not None:
        problems.append("init_from: a script loads its own weights (model.load_state_dict(...)) before s.model; "
                        "init_from is for task jobs")  # fmt: skip
    if train.strategy != "ddp":
        problems.append(f"train.strategy={train.strategy}: a session wraps its models in DDP")
    if train.global_batch_size is not None:
        problems.append(f"train.global_batch_size={train.global_batch_size}: s.batches(dataset, batch_size) gives "
                        "batch_size samples per rank per step (the global batch is batch_size x s.world_size); "
                        "accumulate with train.grad_accum and s.micro_batches(batch)")  # fmt: skip
    own = "the script builds its own optimizer"
    for key, fix in (("optimizer", f"{own} (e.g. torch.optim.AdamW(model.parameters(), lr=3e-4))"),
                     ("lr", f"{own}: pass the learning rate to it"),
                     ("momentum", f"{own}: pass momentum to it"),
                     ("weight_decay", f"{own}: pass weight_decay to it"),
                     ("min_lr", "the script builds its own schedule (keep it with s.keep)"),
                     ("warmup_steps", "the script builds its own schedule (keep it with s.keep)")):  # fmt: skip
        if getattr(train, key) != type(train).model_fields[key].default:  # a file spelling out defaults passes
            problems.append(f"train.{key}={getattr(train, key)}: {fix}; leave train.{key} unset")
    if problems:
        raise ConfigError(problems, "The job config, for a session,")


def _record_error(exc: BaseException) -> None:
    """torchrun's error file for this worker (what ``@record`` writes for ``ddp-service train``)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
