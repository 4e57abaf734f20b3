"""The in-worker runtime: process groups, the tracked state and the checkpointed step loop."""

from resilient.exitcodes import ExitCode
from resilient.runtime.runtime import Runtime, RuntimeConfig, current, init
from resilient.runtime.watchdog_config import WatchdogConfig

__all__ = ["ExitCode", "Runtime", "RuntimeConfig", "WatchdogConfig", "current", "init"]
