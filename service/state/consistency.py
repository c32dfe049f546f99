"""Every rank of a world runs the same training config, or none starts.

The rendezvous refuses a second *job* under a run id; this check catches
ranks of one job started with different settings (a stale config file on one
node, a different ``--set``). At start, before any step, the ranks all-gather
the JSON of their training-relevant fields over the control group (no
pickle), and a mismatch names the ranks and the fields.
"""

from __future__ import annotations

import json
from typing import Any

from service.config import JobConfig
from service.state.resume import training_fields
from service.world.distributed import all_gather_bytes

# A config error: torchrun retries any failed worker group up to --max-restarts, and each retry
# stops here again in seconds, before a step or a write; wrappers read 2 as "fix the input, do not requeue".
EXIT_CONFIG_MISMATCH = 2


class ConfigMismatchError(RuntimeError):
    """Ranks of one world run different training configs."""

    exit_code = EXIT_CONFIG_MISMATCH


def differences(fields: list[dict[str, Any]]) -> list[str]:
    """One line per rank whose fields differ from rank 0's, naming each field with both values."""
    lines = []
    reference = fields[0]
    for rank, theirs in enumerate(fields[1:], start=1):
        changed = [
            f"{key} (rank 0: {reference.get(key)!r}, rank {rank}: {theirs.get(key)!r})"
            for key in sorted(reference.keys() | theirs.keys())
            if reference.get(key) != theirs.get(key)
        ]
        if changed:
            lines.append(f"rank {rank}: {', '.join(changed)}")
    return lines


def check_same_config(config: JobConfig, world_size: int, group: Any) -> None:
    """A collective: raise :class:`ConfigMismatchError` on every rank when any two ranks' configs differ."""
    if world_size == 1:
        return
    local = json.dumps(training_fields(config), sort_keys=True).encode()
    fields = [json.loads(blob) for blob in all_gather_bytes(local, group, world_size)]
    mismatch = differences(fields)
    if mismatch:
        raise ConfigMismatchError(
            "The ranks of this world run different training configs: " + "; ".join(mismatch) + ". Start every "
            "node with the same config file and --set options (check for a stale copy of the file on one node)."
        )
