"""resilient: a fault-tolerant training runtime for PyTorch.

Importing it starts no thread, opens no socket and configures no logger.
"""

__version__ = "0.1.0"

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState, state_digest
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    ResilientError,
    StorageError,
)
from resilient.runtime import ExitCode, Runtime, RuntimeConfig, WatchdogConfig, current, init

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "ConfigError",
    "ExitCode",
    "ResilientError",
    "Runtime",
    "RuntimeConfig",
    "StorageError",
    "TrainState",
    "WatchdogConfig",
    "__version__",
    "current",
    "init",
    "state_digest",
]
