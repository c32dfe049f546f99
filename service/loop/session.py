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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

from service import early
from service.config import ConfigError, JobConfig, apply_overrides, build_config, load_config
from service.loop.session_config import refuse_unused, split_argv
from service.loop.session_loop import LockLost, Preempted, SessionError, SessionLoop, Stopped
from service.loop.session_tools import SessionTools
from service.state.preemption import EXIT_COMPLETED, EXIT_FAILED, Preemption, exit_code_of, ignore_stop_signals

log = logging.getLogger("service.loop.train")


class LeftAlone(Stopped):
    """This rank left its loop at a step where other ranks went on (a ``break`` on some ranks only): nothing more
    is saved, and the job ends; exit 1. The message names the ranks and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_FAILED)
        self.message = message

    def __str__(self) -> str:
        return self.message


__all__ = ["LeftAlone", "LockLost", "Preempted", "Session", "SessionError", "Stopped", "refuse_unused", "split_argv"]


class Session(SessionLoop, SessionTools):
    """The service around a script's own loop (module docstring); its data loop (``s.epochs``, ``s.batches``) in
    :mod:`service.loop.session_loop`, its tools (precision, accumulation, evaluation, coordination, ``s.steps``) in
    :mod:`service.loop.session_tools`. Public API: add, never rename."""

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


def _record_error(exc: BaseException) -> None:
    """torchrun's error file for this worker (what ``@record`` writes for ``ddp-service train``)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
