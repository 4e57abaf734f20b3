"""resilient: a fault-tolerant training runtime for PyTorch.

Importing it starts no thread, opens no socket and configures no logger. The public names
below are imported on first use, so `resilient run` (resilient/supervisor/) and
`resilient.envvars` load neither the worker runtime nor torch.distributed.checkpoint.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from resilient.version import __version__

if TYPE_CHECKING:
    from resilient.checkpoint import (
        CheckpointConfig,
        CheckpointManager,
        TrainState,
        state_digest,
    )
    from resilient.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        ConfigError,
        ResilientError,
        StorageError,
    )
    from resilient.exitcodes import ExitCode
    from resilient.hang.config import WatchdogConfig
    from resilient.runtime import Runtime, RuntimeConfig, current, init
    from resilient.weights.load import load_model

_HOME = {
    "CheckpointConfig": "resilient.checkpoint",
    "CheckpointManager": "resilient.checkpoint",
    "TrainState": "resilient.checkpoint",
    "state_digest": "resilient.checkpoint",
    "CheckpointCorruptError": "resilient.errors",
    "CheckpointError": "resilient.errors",
    "CheckpointMismatchError": "resilient.errors",
    "ConfigError": "resilient.errors",
    "ResilientError": "resilient.errors",
    "StorageError": "resilient.errors",
    "ExitCode": "resilient.exitcodes",
    "Runtime": "resilient.runtime",
    "RuntimeConfig": "resilient.runtime",
    "WatchdogConfig": "resilient.hang.config",
    "current": "resilient.runtime",
    "init": "resilient.runtime",
    "load_model": "resilient.weights.load",
}

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
    "load_model",
    "state_digest",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
