"""How a start ends, the parts a :class:`~service.loop.runtime.Runtime` reads there: whether no restart follows
(``last_attempt``) and what ``summary.json`` holds (``make_summary``)."""

from __future__ import annotations

from typing import Any

from service.world.env import WorldInfo


def last_attempt(world: WorldInfo) -> bool:
    """No restart of this node's workers will come: what this start leaves in shared memory, nobody reads."""
    return world.restart_count >= world.max_restarts


def make_summary(rt: Any, status: str, seconds: float, trained: int, error: str | None = None) -> dict[str, Any]:
    """What ``summary.json`` holds; ``samples_per_second`` counts what this start trained, not the samples before
    the resumed step. The task loop adds its evaluation's entries (``final_loss``, ``eval_metric``, ...)."""
    state, roles, feed = rt.state, rt.roles, rt.feed
    snapshots = roles.snapshots
    micro_steps = getattr(getattr(feed, "plan", None), "micro_steps", 1)
    return {
        "status": status,
        "stopped_at_step": state.global_step if status != "completed" else None,
        "error": error,
        "left_loop": None,  # a script's loop left before its end: the step, the ranks that left, every rank or not
        "resumed_from": rt.resumed.describe() if rt.resumed else None,
        "task": rt.label,
        "model_digest": rt.kept.digest(),
        "global_step": state.global_step,
        "total_steps": rt.total_steps,
        "samples_seen": state.samples_seen,
        "epochs_completed": state.epochs_completed,
        "dropped_batches": state.dropped_batches,  # an uneven stream's epochs: batches left untrained, all ranks
        "world_size": rt.world.world_size,
        "global_batch_size": feed.global_batch if feed is not None else None,
        "grad_accum": max(micro_steps, rt.config.train.grad_accum),  # a session's: s.micro_batches
        "restarts": rt.world.restart_count,
        "max_restarts": rt.world.max_restarts,
        "nonfinite_steps": rt.nonfinite.skipped if rt.nonfinite is not None else 0,
        "final_loss": None,
        "eval_metric": {"name": None, "value": None},
        "eval_metrics": dict(rt.evaluated),
        "logged": dict(rt.last_report.world_values) if rt.last_report is not None else {},
        "checkpoint": {
            "last": str(roles.checkpointer.last_path or "") or None,
            "failures": roles.checkpointer.failures,
            "best": roles.checkpointer.best.describe() if roles.checkpointer.best else None,
        },
        "snapshots": {
            "written": snapshots.written,
            "skipped": snapshots.skipped,
            "every": rt.snapshot_schedule.every,
            "intervals": list(rt.snapshot_schedule.intervals),
        },  # fmt: skip
        "goodput": roles.goodput.finish(status),  # rank 0: the job's breakdown over every start (None else)
        "wall_seconds": round(seconds, 3),
        "samples_per_second": round(trained / seconds, 2) if seconds > 0 else None,
        "launcher": rt.world.launcher,
        "scheduler": rt.world.scheduler,
        "device": rt.device.type,
        "startup": rt.startup.as_dict(),  # seconds from the process's start to the end of each start-up phase
    }
