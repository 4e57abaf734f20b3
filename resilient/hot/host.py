"""What hot recovery needs from the runtime it recovers, as a protocol.

hot/ sits below runtime/ in the layers (docs/internals.md): it never imports the Runtime. The
Runtime hands itself to `HotRecovery` as a `RecoveryHost`, and these few members are the
whole of what recovery reads or calls on it.
"""

from __future__ import annotations

from typing import Protocol

from resilient.checkpoint import TrainState
from resilient.groups.groups import DistContext
from resilient.hang.watchdog import Watchdog
from resilient.memory.snapshot import Snapshots
from resilient.mesh import MeshLayout


class RecoveryHost(Protocol):
    ctx: DistContext
    state: TrainState
    snapshots: Snapshots
    watchdog: Watchdog
    layout: MeshLayout
    """The mesh by role (set at track()): whose replicate peers hold a rank's shards."""
    lost_save: int | None
    """After abandon(): the step of a durable save that lost the peer and did not commit."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def abandon(self, *, drain_s: float) -> bool:
        """Take the runtime down without waiting on the lost peer; False: a save or replica
        in flight did not drain within `drain_s`."""
        ...

    def saves_on_schedule(self, step: int) -> bool:
        """The step policy saves at `step` (a replay will make that save again)."""
        ...
