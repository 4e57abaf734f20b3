"""Resuming on another world size: the global data position and gradient accumulation.

On the same world size every rank gets its own dataloader state back (exact resume, bit for
bit). On another one, per-rank state cannot be mapped, so the checkpoint also holds, in its
common blob, the global position: the epoch and the samples all ranks consumed in it together
(batches.py explains why that number is exact for a DistributedSampler), plus the global batch
size. After loading on W' ranks each rank's sampler continues at consumed / W', and the number
of micro-batches per optimizer step becomes global_batch / (per-rank batch * W'), so every
step still sees the same samples a run that never changed size would see.
"""

from __future__ import annotations

from typing import Any

from resilient.data.batches import ResumableBatches
from resilient.errors import ConfigError
from resilient.log import get_logger

__all__ = ["DataPosition"]


class DataPosition:
    """The tracked loader's world-size-independent position and the global batch size.

    A Stateful for the checkpoint's common blob (every rank computes the same value).
    `apply(world_size)` after a load repositions the loader when the world size changed.
    """

    def __init__(
        self, batches: ResumableBatches, *, world_size: int, global_batch_size: int | None
    ) -> None:
        self.batches = batches
        self.world_size = world_size
        self._explicit = global_batch_size
        self.per_rank_batch = int(getattr(batches.loader, "batch_size", None) or 0)
        if global_batch_size is not None and global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.global_batch = global_batch_size or (self.per_rank_batch * world_size or None)
        self._loaded: dict[str, Any] | None = None
        self.grad_accum = self._accum(self.global_batch)

    def _accum(self, global_batch: int | None) -> int:
        if global_batch is None or not self.per_rank_batch:
            return 1
        per_step = self.per_rank_batch * self.world_size
        if global_batch % per_step:
            raise ConfigError(
                f"global batch {global_batch} does not split into micro-batches of "
                f"{self.per_rank_batch} samples on {self.world_size} ranks: pick a per-rank "
                f"batch size or rank count whose product divides {global_batch}"
            )
        return global_batch // per_step

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        pos = self.batches.global_position()
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "epoch": pos[0] if pos is not None else None,
            "consumed": pos[1] if pos is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = dict(state)  # applied in apply(): the per-rank state loads after us

    # ------------------------------------------------------------------ after a load
    def apply(self) -> None:
        """After a checkpoint load: adopt its global batch, and reposition the loader when
        the world size differs from the one that saved it. Raises ConfigError when the global
        batch cannot be kept on this world size."""
        saved = self._loaded
        self._loaded = None
        if saved is None:
            return
        log = get_logger()
        if self._explicit is None and saved.get("global_batch"):
            self.global_batch = int(saved["global_batch"])
        elif self._explicit is not None and saved.get("global_batch") not in (None, self._explicit):
            log.warning(
                "data.global_batch_changed",
                saved=saved.get("global_batch"),
                now=self._explicit,
            )
        self.grad_accum = self._accum(self.global_batch)
        old_world = int(saved.get("world_size") or self.world_size)
        if old_world == self.world_size:
            return  # every rank got its own loader state back
        if saved.get("consumed") is None:
            log.warning(
                "data.reshard_skipped",
                saved_world_size=old_world,
                world_size=self.world_size,
                reason="the checkpoint has no global data position (no DistributedSampler "
                "with a fixed batch size when it was saved): the loader starts its epoch over",
            )
            return
        try:
            self.batches.seek(int(saved["epoch"]), int(saved["consumed"]))
        except ValueError as e:
            raise ConfigError(
                f"cannot resume the data position on {self.world_size} ranks: {e}"
            ) from e
        log.warning(
            "data.reshard",
            saved_world_size=old_world,
            world_size=self.world_size,
            epoch=int(saved["epoch"]),
            consumed=int(saved["consumed"]),
            global_batch=self.global_batch,
            grad_accum=self.grad_accum,
        )
