"""A session's data loop (mixed into :class:`service.Session`): ``s.epochs``, ``s.batches`` and ``s.epoch_step``,
the cache of feeds (one live feed; a replaced one's loader workers shut down), and how the loop stops (the errors
it raises: :class:`Preempted`, :class:`LockLost`, :class:`SessionError`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from service.config.errors import Refusal
from service.state.preemption import EXIT_FAILED, EXIT_PREEMPTED


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


EPOCHS = "__epochs__"  # s.epochs(n)'s count among the kept objects (no script names one so)


class EpochCount:
    """The count of ``s.epochs(n)``, in every checkpoint: a resume that passes another count is refused."""

    def __init__(self, count: int) -> None:
        self.count = count

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.count}

    def load_state_dict(self, state: Any) -> None:
        saved = int(state["epochs"])
        if saved != self.count:
            raise SessionError(f"s.epochs({self.count}): the run this resumes from counted {saved} epochs "
                               f"(s.epochs({saved})), and a run's epoch count stays as it started, as train.epochs "
                               f"does. Pass s.epochs({saved}) (e.g. the same --num_train_epochs), or start afresh "
                               "with --set checkpoint.resume=never.")  # fmt: skip


class SessionLoop:
    """The data loop's calls, on a session whose runtime is ``self._rt`` (mixed into :class:`service.Session`)."""

    _feeds: dict[tuple[Any, ...], Any]
    _epoch: int | None
    _last_feed: Any
    _running: bool
    _ending: BaseException | None
    _rt: Any
    config: Any
    _stepped: Callable[[int], None]  # the tools' check of the first step (SessionTools)

    def _seen(self, exc: BaseException) -> None:
        """A refusal on its way out of a session call: the end at exit (no ``with``) reads it."""
        self._ending = exc

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

    def epochs(self, n: int | None = None) -> Iterator[int]:
        """The epochs left (``n``, the script's own count, else ``train.epochs``; from the one a resume stands in);
        within one, ``s.batches`` gives that epoch's batches only. ``n`` is the run's ``train.epochs`` from here on:
        it bounds the run as that key does (``train.max_steps`` may end it sooner), it is kept in every checkpoint,
        and a resume must pass the same. Call it before the first ``s.batches``. A ``train.epochs`` set in the config
        or with ``--set`` to another number is refused, naming both (one run has one count)."""
        if n is not None:
            with self._refusals():
                self._count_epochs(n)
        return self._epochs()

    def _count_epochs(self, n: int) -> None:
        """``s.epochs(n)``: ``n`` becomes the run's ``train.epochs``, kept (checked against the resumed run's)."""
        from service.state.checkpoint_io import kept_names

        rt = self._rt
        call = f"s.epochs({n!r})"
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SessionError(f"{call}: n is the run's number of epochs, a whole number of at least 1 (e.g. "
                               "s.epochs(args.num_train_epochs)); or call s.epochs() to take "
                               "train.epochs.")  # fmt: skip
        train = rt.config.train
        kept = rt.kept.shared.get(EPOCHS)
        if kept is not None and kept.count == n:
            return  # the same count again (a second loop over the epochs)
        if kept is not None or rt.kept.closed_for is not None:
            before = f"s.epochs({kept.count})" if kept is not None else rt.kept.closed_for
            raise SessionError(f"{call} came after {before}: "
                               "a run counts its epochs once, before its first s.batches. Call s.epochs(n) once, "
                               "above the loop.")  # fmt: skip
        if "epochs" in train.model_fields_set and train.epochs != n:
            raise SessionError(f"{call} and train.epochs={train.epochs} (the config or --set) both set the run's "
                               "number of epochs, and they differ: one run has one count. Leave train.epochs unset "
                               f"(the script's count, {n}, rules), or call s.epochs() to take "
                               "train.epochs.")  # fmt: skip
        resumed = rt.resumed.state if rt.resumed is not None else None
        if resumed is not None and EPOCHS not in kept_names(resumed):
            saved = resumed.get("config", {}).get("train", {}).get("epochs")
            raise SessionError(f"{call}: the run this resumes from counted its epochs by train.epochs={saved}, not "
                               "by s.epochs(n), and a run's epoch count stays as it started. Call s.epochs() as it "
                               "did, or start afresh with --set checkpoint.resume=never.")  # fmt: skip
        rt.config = self.config = rt.config.model_copy(update={"train": train.model_copy(update={"epochs": n})})
        rt.kept.keep({EPOCHS: EpochCount(n)}, False, "s.epochs")  # a resume loads (and checks) the saved count here

    def _epochs(self) -> Iterator[int]:
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
