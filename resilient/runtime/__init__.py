"""The in-worker runtime: process groups, the tracked state and the checkpointed step loop."""

from resilient.runtime.runtime import Runtime, RuntimeConfig, init

__all__ = ["Runtime", "RuntimeConfig", "init"]
