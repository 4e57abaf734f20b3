"""What every checkpoint manager implements: CheckpointManager (one location) and
TieredCheckpointManager (a fast local tier and a durable one) alike.

The Runtime, the CLI and the benchmarks talk to this interface only; `open_manager()` picks
the implementation from the config. Every method is called by every rank of the manager's
process group in the same order (they agree through `collectives`).
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from resilient.checkpoint.collectives import Collectives
    from resilient.checkpoint.config import CheckpointConfig, CheckpointInfo
    from resilient.checkpoint.manifest import Manifest
    from resilient.checkpoint.state import TrainState

__all__ = ["CheckpointStore"]


class CheckpointStore(Protocol):
    config: CheckpointConfig
    collectives: Collectives
    rank: int
    world_size: int

    @property
    def last_committed(self) -> int | None:
        """The newest step this process saved or loaded and saw committed."""

    @property
    def in_flight(self) -> bool:
        """An async save is still being written."""

    def check_writable(self) -> None:
        """Prove the location(s) writable before training starts; StorageError otherwise."""

    def list(self) -> builtins.list[CheckpointInfo]:
        """Checkpoint directories, oldest first (foreign names ignored)."""

    def candidates(self) -> builtins.list[int]:
        """Committed steps, newest first, the same on every rank."""

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of checkpoint `step`; CheckpointCorruptError when unreadable."""

    def verify(self, step: int, manifest: Manifest) -> builtins.list[str]:
        """This rank's share of a full check of `step`'s files; the problems found."""

    def save(self, state: TrainState, step: int, *, blocking: bool | None = None) -> None:
        """Checkpoint `state` as taken after `step` steps (async unless `blocking`)."""

    def wait_staged(self) -> None:
        """Block until no save in flight reads live tensors."""

    def wait(self) -> int | None:
        """Wait for the save in flight; its committed step, or None."""

    def note_numerical_fault(self, step: int, **details: Any) -> int:
        """Record a numerical fault detected at `step` beside the checkpoints (every tier);
        the first fault step recorded there. Retention then keeps the newest checkpoint
        from before it. CheckpointError when the record there cannot be read."""

    def numerical_faults(self) -> builtins.list[int]:
        """The steps of the numerical faults recorded beside the checkpoints (every tier),
        as rank 0 reads them (a collective)."""

    def load_latest(self, state: TrainState) -> int | None:
        """Load the newest checkpoint that verifies; its step, or None (a fresh start)."""

    def try_load(self, state: TrainState, step: int, *, started: float | None = None) -> bool:
        """Load checkpoint `step` if it verifies; False (logged) when it does not."""

    def close(self) -> None:
        """Wait for the save in flight and release threads and buffers."""
