"""How a global batch is split on a data-parallel degree, under the user's batch policy.

A run keeps its global batch G on another data-parallel degree D by gradient accumulation:
G / (B x D) micro-batches of the loader's batch size B per optimizer step. When B x D does
not divide G (24 on 2 ranks of 8: the third node of three was lost), the policy decides:

- "exact" (the default): keep G exactly. Each rank takes G / D samples a step, in
  micro-batches of the largest size m <= B that divides G / D (6 on 2 ranks of 8: 2
  micro-batches of 6), so every micro-batch is the same size and a loss divided by
  `rt.grad_accum` is the mean over the step's samples: the loss weighted by samples. The
  samples are exactly those a run that never changed would use; the bits are not (micro-
  batches of another size add their gradients in another order), and the event says so.
  When D does not divide G (32 on 3 ranks), equal per-rank shares are impossible with a
  DistributedSampler: the run follows, with the reason in the event.
- "follow": keep the per-rank batch, as torchft, Lightning and the Hugging Face Trainer do:
  the global batch becomes B x D x max(1, G // (B x D)) and follows the world size.

Pure functions of (G, B, D, policy): every rank, and `resilient run`'s start-up table
(supervisor/batchplan.py), compute the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BATCH_POLICIES", "DEFAULT_POLICY", "Split", "split_batch"]

BATCH_POLICIES = ("exact", "follow")
DEFAULT_POLICY = "exact"


@dataclass(frozen=True, slots=True)
class Split:
    micro: int
    """Samples per micro-batch on each rank (the loader's batch size unless "exact" chose
    another)."""
    accum: int
    """Micro-batches per optimizer step."""
    effective: int
    """The global batch this split trains on: micro x accum x dp."""
    how: str
    """"kept" (the loader's batch size divides it), "exact" (micro-batches of another size),
    or "follows" (the global batch changed)."""
    reason: str = ""

    def describe(self) -> str:
        if self.how == "kept":
            return f"kept: {self.accum} micro-batch(es) of {self.micro} per rank, bitwise"
        if self.how == "exact":
            return (
                f"kept exactly: {self.accum} micro-batch(es) of {self.micro} per rank "
                "(sample-exact, not bitwise from the change on)"
            )
        return f"follows the world: global batch {self.effective} ({self.reason})"


def split_batch(global_batch: int, per_rank: int, dp: int, policy: str) -> Split:
    """The split of `global_batch` over `dp` data-parallel ranks whose loader yields
    `per_rank` samples a batch, under `policy`."""
    if policy not in BATCH_POLICIES:
        raise ValueError(f"batch policy must be one of {BATCH_POLICIES}, got {policy!r}")
    per_step = per_rank * dp
    if global_batch % per_step == 0:
        return Split(per_rank, global_batch // per_step, global_batch, "kept")
    if policy == "exact" and global_batch % dp == 0:
        share = global_batch // dp
        micro = max(m for m in range(1, min(per_rank, share) + 1) if share % m == 0)
        return Split(micro, share // micro, global_batch, "exact")
    accum = max(1, global_batch // per_step)
    if policy == "exact":
        reason = (
            f"batch policy exact, but {global_batch} does not split into equal shares on "
            f"{dp} ranks: the per-rank batch {per_rank} is kept"
        )
    else:
        reason = f"batch policy follow: the per-rank batch {per_rank} is kept"
    return Split(per_rank, accum, per_step * accum, "follows", reason)
