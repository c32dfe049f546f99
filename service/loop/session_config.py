"""A session's config: ``--config``/``--set`` taken off a script's command line, and the keys a script's own loop
cannot honour, refused at start naming what replaces each."""

from __future__ import annotations

from collections.abc import Sequence

from service.config import ConfigError, JobConfig


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
