"""Two checkpoint tiers: frequent saves to a fast local directory, every N-th to durable storage.

The idea of Orbax's emergency checkpointing and NVIDIA's local checkpoints, in its simplest
form: a node's local disk is fast but dies with the node, object storage survives it but is
slow. Each tier is an ordinary CheckpointManager (same format, commit protocol, retention);
this class only routes saves and picks the newest valid checkpoint across both.

    config = CheckpointConfig(url="s3://bucket/run1", local_url="/nvme/ckpt", remote_every=5)
    manager = open_manager(config, process_group=pg)

Routing: every `remote_every`-th save goes to `url`, the others to `local_url`. An explicit
`save(..., blocking=True)` (end of training, preemption, stop_at) goes to `url` too: those
are the moments a node is about to go away. Loading takes the newest checkpoint over both
tiers that verifies against its manifest, the local one on a tie (it is faster), and falls
back through both tiers, newest first.

Limits: one save at a time across tiers (both share the process group), so a local save waits
for a durable save still in flight; and the local directory must be shared by all ranks (all
ranks on one host, or a shared filesystem): DCP keeps replicated state in rank 0's file, which
ranks on other hosts could not read. `check_writable()` verifies this before training starts.
"""

from __future__ import annotations

import builtins
import dataclasses
import time
import uuid
from typing import Any

from resilient.checkpoint.config import CheckpointConfig, CheckpointInfo
from resilient.checkpoint.manager import CheckpointManager
from resilient.checkpoint.manifest import Manifest
from resilient.checkpoint.protocol import CheckpointStore
from resilient.checkpoint.state import TrainState
from resilient.errors import ConfigError
from resilient.log import get_logger

__all__ = ["LOCAL", "REMOTE", "TieredCheckpointManager", "open_manager"]

LOCAL = "local"
REMOTE = "remote"


def open_manager(config: CheckpointConfig, *, process_group: Any = None) -> CheckpointStore:
    """A TieredCheckpointManager when `config.local_url` is set, else a CheckpointManager."""
    if config.local_url is None:
        return CheckpointManager(config, process_group=process_group)
    return TieredCheckpointManager(config, process_group=process_group)


class TieredCheckpointManager:
    """A CheckpointStore (as CheckpointManager) over a local tier (`local_url`) and a durable
    one (`url`).

    Every rank of `process_group` must make the same calls in the same order.
    """

    def __init__(self, config: CheckpointConfig, *, process_group: Any = None) -> None:
        if config.local_url is None:
            raise ConfigError("TieredCheckpointManager needs CheckpointConfig.local_url")
        self.config = config
        self.remote = CheckpointManager(
            dataclasses.replace(config, local_url=None), process_group=process_group
        )
        # The local tier is a plain directory: no remote options, and a failed local save
        # follows the same on_save_error as a remote one.
        self.local = CheckpointManager(
            dataclasses.replace(config, url=config.local_url, local_url=None, storage_options={}),
            process_group=process_group,
        )
        self.tiers = {LOCAL: self.local, REMOTE: self.remote}
        self.collectives = self.remote.collectives
        """The agreement helper of the process group both tiers share."""
        self.rank = self.remote.rank
        self.world_size = self.remote.world_size
        self._saves = 0
        self._log = get_logger()

    # ---------------------------------------------------------------- discovery
    @property
    def last_committed(self) -> int | None:
        steps = [m.last_committed for m in self.tiers.values() if m.last_committed is not None]
        return max(steps) if steps else None

    @property
    def in_flight(self) -> bool:
        return self.local.in_flight or self.remote.in_flight

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints of both tiers (`tier` set), oldest first; local first on equal steps."""
        found = [
            dataclasses.replace(info, tier=name)
            for name, m in self.tiers.items()
            for info in m.list()
        ]
        return sorted(found, key=lambda i: (i.step, i.tier != LOCAL))

    def candidates(self) -> builtins.list[int]:
        """Committed steps of either tier, newest first, as rank 0 lists them."""
        return sorted({s for m in self.tiers.values() for s in m.candidates()}, reverse=True)

    def try_load(self, state: TrainState, step: int, *, started: float | None = None) -> bool:
        """Load checkpoint `step` from the first tier that holds it and verifies (local
        first); False when none does (each failure logged as ckpt.fallback)."""
        for name in (LOCAL, REMOTE):
            m = self.tiers[name]
            if step in m.candidates() and m.try_load(state, step, started=started):
                return True
        return False

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of checkpoint `step`, from the local tier when it has it."""
        for name in (LOCAL, REMOTE):
            if step in self.tiers[name].candidates():
                return self.tiers[name].read_manifest(step)
        return self.remote.read_manifest(step)

    def verify(self, step: int, manifest: Manifest) -> builtins.list[str]:
        """This rank's share of the file checks of `step`, in the tier `read_manifest` read."""
        for name in (LOCAL, REMOTE):
            if step in self.tiers[name].candidates():
                return self.tiers[name].verify(step, manifest)
        return self.remote.verify(step, manifest)

    def check_writable(self) -> None:
        """Prove both tiers writable and the local one shared by all ranks (a collective).

        Raises StorageError naming the location and the fix, or ConfigError when some ranks do
        not see rank 0's files in the local directory.
        """
        self.remote.check_writable()
        self.local.check_writable()
        self._check_local_is_shared()

    def _check_local_is_shared(self) -> None:
        storage = self.local.storage
        token = f".resilient-shared-{uuid.uuid4().hex[:8]}" if self.rank == 0 else ""
        if self.rank == 0:
            storage.write_bytes_atomic(token, b"ok")
        token = self.collectives.broadcast(token)
        seen = self.collectives.gather_all(storage.exists(token))
        if self.rank == 0:
            storage.remove_file(token)
        blind = [r for r, ok in enumerate(seen) if not ok]
        if blind:
            raise ConfigError(
                f"local_url {storage.url!r} is not one directory shared by all ranks: ranks "
                f"{blind} do not see rank 0's files there. Run all ranks on one host, use a "
                "shared filesystem, or leave local_url unset."
            )

    # ---------------------------------------------------------------- save
    def save(
        self,
        state: TrainState,
        step: int,
        *,
        blocking: bool | None = None,
        tier: str | None = None,
    ) -> None:
        """Checkpoint `state` after `step` steps to one tier (see the module docstring).

        `tier` forces LOCAL or REMOTE. Waits for a save in flight in either tier first.
        Raises as CheckpointManager.save does.
        """
        if tier not in (None, LOCAL, REMOTE):
            raise ConfigError(f"tier must be {LOCAL!r}, {REMOTE!r} or None, got {tier!r}")
        self._saves += 1
        if tier is None:
            due = self._saves % self.config.remote_every == 0
            tier = REMOTE if due or blocking is True else LOCAL
        # One save at a time: both tiers run their collectives on the same process group.
        self.wait()
        self._log.info("ckpt.tier", step=step, tier=tier)
        self.tiers[tier].save(state, step, blocking=blocking)

    def wait_staged(self) -> None:
        """Block until no save in flight reads live tensors."""
        for m in self.tiers.values():
            m.wait_staged()

    def wait(self) -> int | None:
        """Wait for the save in flight in either tier; its committed step, or None."""
        steps = [m.wait() for m in self.tiers.values()]
        done = [s for s in steps if s is not None]
        return max(done) if done else None

    def note_numerical_fault(self, step: int, **details: Any) -> int:
        """Record a numerical fault at `step` in both tiers (the durable one first), so each
        tier's retention keeps its newest checkpoint from before the first fault; the first
        fault step recorded in either. Raises as CheckpointManager.note_numerical_fault."""
        for m in self.tiers.values():  # no save thread may run collectives beside ours
            m.settle()
        return min(m.note_numerical_fault(step, **details) for m in (self.remote, self.local))

    def numerical_faults(self) -> builtins.list[int]:
        """The fault steps recorded in either tier."""
        return sorted({s for m in (self.remote, self.local) for s in m.numerical_faults()})

    # ---------------------------------------------------------------- load
    def load_latest(self, state: TrainState) -> int | None:
        """Load the newest checkpoint of either tier that verifies; return its step.

        Candidates are tried newest first, local before remote on the same step; one that
        fails verification or loading is logged (ckpt.fallback) and the next is tried. None,
        after logging a fresh start, when no tier has a valid one.
        """
        self.wait()
        t0 = time.perf_counter()
        order = sorted(
            [(step, name) for name, m in self.tiers.items() for step in m.candidates()],
            key=lambda x: (-x[0], x[1] != LOCAL),
        )
        fresh = state.optimizer_is_fresh()
        for step, name in order:
            if self.tiers[name].try_load(state, step, started=t0):
                self._log.info("ckpt.tier.loaded", step=step, tier=name)
                return step
        if fresh:
            state.forget_failed_loads()
        self._log.info(
            "ckpt.fresh_start",
            url=self.remote.storage.url,
            local_url=self.local.storage.url,
            reason="no valid checkpoint" if order else "no checkpoint",
        )
        return None

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for saves in flight and release both tiers' threads and buffers."""
        try:
            self.local.close()
        finally:
            self.remote.close()
