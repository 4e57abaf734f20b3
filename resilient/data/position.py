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
same samples a run that never changed shape would see. When the loader's batch size cannot
split the global batch on dp' ranks, the user's batch policy decides (data/policy.py): "exact"
feeds micro-batches of another size, "follow" lets the global batch follow the world; either
way the run goes on, never a ConfigError after a node change.
"""

from __future__ import annotations

from typing import Any

from resilient.data.batches import ResumableBatches
from resilient.data.policy import DEFAULT_POLICY, Split, split_batch
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
        policy: str = DEFAULT_POLICY,
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
        self.policy = policy
        self.global_batch = global_batch_size or (self.per_rank_batch * self.dp or None)
        """The global batch the run keeps where it can (saved; explicit or B x dp at start)."""
        self.effective_batch = self.global_batch
        """The global batch steps train on now: global_batch unless it follows the world."""
        self.micro = self.per_rank_batch
        """Samples per micro-batch on each rank now."""
        self._loaded: dict[str, Any] | None = None
        self._drawn, self._told = batches.drawn, False
        self.grad_accum = self._accum(self.global_batch)

    def _where(self) -> str:
        if not self.layout.model_parallel and self.dp == self.world_size:
            return f"{self.dp} ranks"
        return f"{self.dp} data-parallel ranks (mesh {self.layout.describe()})"

    def _accum(self, global_batch: int | None) -> int:
        """Micro-batches per step for `global_batch` on this dp degree, under the policy;
        sets the loader's micro-batch size when "exact" needs another one, and logs a
        change of the micro-batch size or of the global batch (one event)."""
        if global_batch is None or not self.per_rank_batch:
            return 1
        split = split_batch(global_batch, self.per_rank_batch, self.dp, self.policy)
        if split.micro != self.micro and not self.batches.set_batch_size(split.micro):
            why = "the loader has no batch sampler whose batch size can change"
            split = split_batch(global_batch, self.per_rank_batch, self.dp, "follow")
            split = Split(split.micro, split.accum, split.effective, split.how, why)
        self.micro, self.effective_batch = split.micro, split.effective
        log = get_logger()
        said, self._said = getattr(self, "_said", None), split
        if said == split:  # a rollback or a second load: said once
            return split.accum
        if split.how == "kept":  # what `resilient run` reads for its start-up table
            log.info(
                "data.batch",
                global_batch=global_batch,
                dp=self.dp,
                world_size=self.world_size,
                per_rank_batch=self.per_rank_batch,
                grad_accum=split.accum,
                policy=self.policy,
            )
        elif split.how == "exact":
            log.warning(
                "data.batch_exact",
                world_size=self.world_size,
                global_batch=global_batch,
                dp=self.dp,
                per_rank_batch=self.per_rank_batch,
                micro_batch=split.micro,
                grad_accum=split.accum,
                policy=self.policy,
                bitwise=False,
                reason=f"the loader's batch of {self.per_rank_batch} does not split the "
                f"global batch on {self._where()}: the same samples every step in micro-"
                f"batches of {split.micro}, the loss weighted by samples; the gradients add "
                "in another order, so the bits differ from this step on",
            )
        elif split.how == "follows":
            log.warning(
                "data.batch_follows",
                world_size=self.world_size,
                old_global_batch=global_batch,
                new_global_batch=split.effective,
                dp=self.dp,
                per_rank_batch=self.per_rank_batch,
                grad_accum=split.accum,
                policy=self.policy,
                reason=split.reason,
            )
        return split.accum

    def step_end(self, step: int) -> None:
        """After each step: one warning (`data.accum_ignored`) when the loop took some of the
        tracked loader's batches, but fewer than `grad_accum`: it does not loop over
        rt.grad_accum, so the global batch is not kept (the data position still is)."""
        drawn, self._drawn = self.batches.drawn - self._drawn, self.batches.drawn
        if self._told or not 0 < drawn < self.grad_accum:
            return
        self._told = True
        get_logger().warning(
            "data.accum_ignored",
            step=step,
            batches=drawn,
            grad_accum=self.grad_accum,
            global_batch=self.effective_batch,
            trained_on=drawn * self.micro * self.dp,
            reason=f"step {step} took {drawn} of the {self.grad_accum} batches rt.grad_accum "
            f"asks for: it trained on {drawn * self.micro * self.dp} samples, not the global "
            f"batch of {self.effective_batch}. Loop `for _ in range(rt.grad_accum)` over "
            "next(batches) (docs/porting.md#elastic-world-size)",
        )

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        pos = self.batches.global_position()
        return {
            "world_size": self.world_size,
            "layout": self.layout.signature(),
            "dp": self.dp,
            "global_batch": self.global_batch,
            "micro": self.micro,
            "epoch": pos[0] if pos is not None else None,
            "consumed": pos[1] if pos is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = dict(state)  # applied in apply(): the per-rank state loads after us
        if self._explicit is None and state.get("global_batch"):
            self.global_batch = int(state["global_batch"])
        # now, before the loader's own state loads: its batches are counted in this size
        self.grad_accum = self._accum(self.global_batch)

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
        if self._explicit is not None and saved.get("global_batch") not in (None, self._explicit):
            log.warning(
                "data.global_batch_changed",
                saved=saved.get("global_batch"),
                now=self._explicit,
            )
        old_world = int(saved.get("world_size") or self.world_size)
        change = self.layout.change_from(str(saved.get("layout") or ""), old_world)
        same_micro = int(saved.get("micro") or self.per_rank_batch) == self.micro
        if change == "same" and same_micro:
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
        if change == "same":  # its own loader state counts batches of another size
            self.batches.drop_loaded_state()
        log.warning(
            "data.reshard",
            saved_world_size=old_world,
            world_size=self.world_size,
            saved_dp=old_dp,
            dp=self.dp,
            epoch=int(saved["epoch"]),
            consumed=int(saved["consumed"]),
            global_batch=self.global_batch,
            effective_batch=self.effective_batch,
            micro_batch=self.micro,
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
