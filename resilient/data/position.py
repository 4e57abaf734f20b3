"""Resuming on another world size or mesh: the global data position and gradient accumulation.

Data is counted over the data-parallel ranks only (resilient/mesh/): on a dp x tp mesh the tp
peers of a rank draw the same batch, so a step consumes per-rank batch x dp degree samples,
not x world size. On the same world size and mesh layout every rank gets its own dataloader
state back (exact resume, bit for bit). Otherwise per-rank state cannot be mapped, so the
checkpoint also holds, in its common blob, the global position: the epoch and the samples all
data-parallel ranks consumed in it together (batches.py explains why that number is exact for
a DistributedSampler), plus the global batch size. After loading on dp' data-parallel ranks
each rank's sampler continues at consumed / dp', and the number of micro-batches per
optimizer step becomes global_batch / (per-rank batch * dp'), so every step still sees the
same samples a run that never changed shape would see.
"""

from __future__ import annotations

from typing import Any

from resilient.data.batches import ResumableBatches
from resilient.errors import ConfigError
from resilient.log import get_logger
from resilient.mesh import MeshLayout

__all__ = ["DataPosition"]


class DataPosition:
    """The tracked loader's position independent of world size and mesh, and the global batch.

    A Stateful for the checkpoint's common blob (every rank computes the same value).
    `apply()` after a load repositions the loader when the world size or the layout changed.
    """

    def __init__(
        self,
        batches: ResumableBatches,
        layout: MeshLayout,
        rank: int,
        global_batch_size: int | None,
    ) -> None:
        self.batches = batches
        self.layout = layout
        self.world_size = layout.world_size
        self.dp = layout.dp_degree
        self._explicit = global_batch_size
        self.per_rank_batch = int(getattr(batches.loader, "batch_size", None) or 0)
        if global_batch_size is not None and global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be >= 1, got {global_batch_size}")
        check_sampler(batches, layout, rank)
        self.global_batch = global_batch_size or (self.per_rank_batch * self.dp or None)
        self._loaded: dict[str, Any] | None = None
        self.grad_accum = self._accum(self.global_batch)

    def _where(self) -> str:
        if not self.layout.model_parallel and self.dp == self.world_size:
            return f"{self.dp} ranks"
        return f"{self.dp} data-parallel ranks (mesh {self.layout.describe()})"

    def _accum(self, global_batch: int | None) -> int:
        if global_batch is None or not self.per_rank_batch:
            return 1
        per_step = self.per_rank_batch * self.dp
        if global_batch % per_step:
            raise ConfigError(
                f"global batch {global_batch} does not split into micro-batches of "
                f"{self.per_rank_batch} samples on {self._where()}: pick a per-rank "
                f"batch size or data-parallel degree whose product divides {global_batch}"
            )
        return global_batch // per_step

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        pos = self.batches.global_position()
        return {
            "world_size": self.world_size,
            "layout": self.layout.signature(),
            "dp": self.dp,
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
        change = self.layout.change_from(str(saved.get("layout") or ""), old_world)
        if change == "same":
            return  # every rank got its own loader state back
        old_dp = int(saved.get("dp") or old_world)
        if saved.get("consumed") is None:
            log.warning(
                "data.reshard_skipped",
                saved_world_size=old_world,
                world_size=self.world_size,
                saved_dp=old_dp,
                dp=self.dp,
                reason="the checkpoint has no global data position (no DistributedSampler "
                "with a fixed batch size when it was saved): the loader starts its epoch over",
            )
            return
        try:
            self.batches.seek(int(saved["epoch"]), int(saved["consumed"]))
        except ValueError as e:
            raise ConfigError(f"cannot resume the data position on {self._where()}: {e}") from e
        log.warning(
            "data.reshard",
            saved_world_size=old_world,
            world_size=self.world_size,
            saved_dp=old_dp,
            dp=self.dp,
            epoch=int(saved["epoch"]),
            consumed=int(saved["consumed"]),
            global_batch=self.global_batch,
            grad_accum=self.grad_accum,
        )


def check_sampler(batches: ResumableBatches, layout: MeshLayout, rank: int) -> None:
    """Ranks with the same data-parallel coordinate must draw the same batch: a
    DistributedSampler must split the data over the data-parallel degree, at this rank's
    data-parallel coordinate. ConfigError naming both and the fix, before step 0."""
    if len(layout.dims) == 1:
        return  # a flat world: the script's own split, as before meshes were known
    sampler = batches.sampler()
    if sampler is None:
        if layout.model_parallel:
            get_logger().warning(
                "data.unchecked",
                mesh=layout.describe(),
                reason="the loader has no DistributedSampler: nothing shows that tp/cp/pp "
                "peers draw the same batch, and the data position cannot move to another "
                "data-parallel degree",
            )
        return
    want, at = layout.dp_degree, layout.dp_rank(rank)
    replicas, sampler_rank = int(sampler.num_replicas), int(sampler.rank)
    if replicas == want and sampler_rank == at:
        return
    peers = [r for r in layout.same_batch(rank) if r != rank]
    sized = "the world" if replicas == layout.world_size and want != replicas else f"{replicas}"
    raise ConfigError(
        f"rank {rank}: the loader's DistributedSampler splits the data over {sized} "
        f"replica(s) at rank {sampler_rank}, but the mesh {layout.describe()} has "
        f"data-parallel degree {want} and this rank's data-parallel coordinate is {at}"
        + (f" (ranks {peers} must draw the same batch as this one)" if peers else "")
        + f": build the sampler with num_replicas={want}, rank=<the data-parallel "
        "coordinate>, e.g. mesh['dp'].get_local_rank() on a flattened data-parallel mesh"
    )
