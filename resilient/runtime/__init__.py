"""The in-worker runtime, the composition root: `resilient.init()` builds a Runtime that wires
process groups, the watchdog, the guard, snapshots, hot recovery and checkpoints together."""

from resilient.runtime.config import RuntimeConfig
from resilient.runtime.runtime import Runtime, current, init

__all__ = ["Runtime", "RuntimeConfig", "current", "init"]
