"""The options of in-memory snapshots (memory/snapshot.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from resilient.envvars import ENV_SNAPSHOT, json_object_env
from resilient.errors import ConfigError

__all__ = ["SnapshotConfig"]


@dataclass(kw_only=True, slots=True)
class SnapshotConfig:
    """In-memory snapshots and in-place rollback (resilient.memory.snapshot)."""

    enabled: bool = False
    """Keep snapshots and roll back in place on an agreed exception. Costs host memory: two
    copies of this rank's checkpoint state (checked at track())."""
    every_steps: int | None = None
    """Snapshot after every N steps; None: adaptive, a power of two that keeps the copy
    under `budget` of the step time (typically 1 on small models)."""
    budget: float = 0.02
    """Share of step time the adaptive interval allows the copies."""
    memory_fraction: float = 0.5
    """Both buffers together may take at most this share of the host memory available at
    track(); more is a ConfigError there, never an out-of-memory kill mid-run."""
    max_retries_per_step: int = 1
    """Rollbacks for a failure of the same rank at the same step; one more goes cold."""
    replicas: int = 1
    """Under hot recovery, copies of each sharded (FSDP2) snapshot kept on another rank (its
    buddy: memory/replica.py), so a lost rank's shards survive it; costs two more buffers of
    the ward's size. 0: local only, and a lost FSDP2 rank goes cold. DDP state needs none:
    every rank holds it."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError(f"snapshot every_steps must be >= 1 or None, got {self.every_steps}")
        if not 0 < self.budget < 1:
            raise ConfigError(f"snapshot budget must be in (0, 1), got {self.budget}")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(
                f"snapshot memory_fraction must be in (0, 1], got {self.memory_fraction}"
            )
        if self.replicas not in (0, 1):
            raise ConfigError(f"snapshot replicas must be 0 or 1, got {self.replicas}")
        if self.max_retries_per_step < 0:
            raise ConfigError(
                f"snapshot max_retries_per_step must be >= 0, got {self.max_retries_per_step}"
            )

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None) -> SnapshotConfig:
        """Defaults, then $RESILIENT_SNAPSHOT, then `overrides`."""
        import os

        raw = os.environ.get(ENV_SNAPSHOT, "").strip().lower()
        fields: dict[str, Any] = (
            {"enabled": True} if raw in {"1", "on", "true"} else json_object_env(ENV_SNAPSHOT)
        )
        fields.update(overrides or {})
        known = {f.name for f in dataclasses.fields(cls)}
        if set(fields) - known:
            raise ConfigError(
                f"unknown snapshot option(s) {sorted(set(fields) - known)}; valid: {sorted(known)}"
            )
        return cls(**fields)
