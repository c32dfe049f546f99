"""Checks that need both the config and the world: run by ``train`` before torch is imported."""

from __future__ import annotations

from service.config import ConfigError, JobConfig
from service.world.env import WorldInfo


def check_against_world(config: JobConfig, world: WorldInfo) -> None:
    """Refuse a config that cannot work in this world; every problem at once, as a :class:`ConfigError`."""
    errors = []
    port = config.metrics.port
    if isinstance(port, int) and port and port + world.local_world_size - 1 > 65535:
        errors.append(
            f"metrics.port={port} with {world.local_world_size} processes on this node: local rank "
            f"{world.local_world_size - 1} would serve on port {port + world.local_world_size - 1}, past 65535. "
            f"Set metrics.port to at most {65536 - world.local_world_size} (or 0 to turn the exporter off)."
        )
    if errors:
        raise ConfigError(errors, "The job config, for this world,")
