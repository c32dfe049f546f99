"""The job config (its models in :mod:`service.config.models`, the file and the overrides read, bounded, in
:mod:`service.config.reading`) and the errors that name their fix (:mod:`service.config.errors`). The config's
public names are named here, as before the package: ``from service.config import JobConfig, load_config``."""

from service.config.models import (
    HANG_TIMEOUT_MIN,
    SEED_MAX,
    SNAPSHOT_MAX_SECONDS,
    TIMEOUT_MAX,
    Amp,
    BestConfig,
    CheckpointConfig,
    Compile,
    DataConfig,
    DDPConfig,
    DistConfig,
    GradClip,
    HangTimeout,
    InitFromConfig,
    JobConfig,
    LoggingConfig,
    MetricsConfig,
    OnOffAuto,
    Port,
    SnapshotEvery,
    SnapshotMaxSeconds,
    TrainConfig,
    build_config,
    config_as_yaml,
    config_keys,
    load_config,
    nearest_key,
)
from service.config.reading import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_VALUES,
    ConfigError,
    apply_overrides,
    read_yaml,
)

__all__ = [
    "HANG_TIMEOUT_MIN", "SEED_MAX", "SNAPSHOT_MAX_SECONDS", "TIMEOUT_MAX", "Amp", "BestConfig", "CheckpointConfig",
    "Compile", "DataConfig", "DDPConfig", "DistConfig", "GradClip", "HangTimeout", "InitFromConfig", "JobConfig",
    "LoggingConfig", "MetricsConfig", "OnOffAuto", "Port", "SnapshotEvery", "SnapshotMaxSeconds", "TrainConfig",
    "build_config", "config_as_yaml", "config_keys", "load_config", "nearest_key",
    "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_VALUES", "ConfigError", "apply_overrides", "read_yaml",
]  # fmt: skip
