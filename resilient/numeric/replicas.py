"""Silent data corruption between replicas: their parameters must be bit-identical.

Under DDP every rank holds the same parameters after every step; under HSDP every rank of one
replicate group (the ranks that differ only along the replicate dimension: MeshLayout's
`replicas`) holds the same local shards. The check compares within each such group: the
local parts of the parameters and buffers, so no collective gathers a DTensor. A flipped bit in one
rank's memory or arithmetic breaks that silently: the run goes on, finite and wrong, and the
corrupt rank's gradients reach every rank through the all-reduce. `replica_fingerprint` sums
each parameter's bytes read as integers (a single flipped bit changes the sum by a power of
two, so it never cancels); the ranks gather the sums and compare. With three or more ranks
the majority names the odd ones; with two, nothing can tell which, and the replay after the
rollback decides (transient, or the same again: persistent).

The check runs before every durable save and every `sdc_every` steps, so every committed
checkpoint was consistent across replicas at its step: a rollback to the newest one undoes
the corruption exactly.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from resilient.groups.groups import DistContext

__all__ = [
    "disagreeing",
    "local_fingerprint",
    "odd_ranks",
    "replica_fingerprint",
    "replicas_agree",
]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def replica_fingerprint(model: nn.Module) -> int:
    """Sum over every parameter and buffer (a DTensor's local shard) of its elements read as
    integers (int64)."""
    return _int_sum([_own(t) for t in [*model.parameters(), *model.buffers()]])


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """As replica_fingerprint, over this rank's own part (the local shards of DTensors) of
    the parameters, buffers and optimizer state: what a re-run of a step must reproduce."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return _int_sum([t.to_local() if hasattr(t, "to_local") else t for t in tensors])


@torch.no_grad()
def _int_sum(tensors: list[torch.Tensor]) -> int:
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        data = t.detach()
        if data.numel() == 0:
            continue
        view = data.contiguous().view(_INT_VIEW[data.element_size()])
        total += view.sum(dtype=torch.int64).cpu()
    return int(total)


def replicas_agree(
    model: nn.Module, ctx: DistContext, groups: list[list[int]] | None = None
) -> list[int] | None:
    """Every rank's fingerprint when the ranks of any replicate group differ, None when each
    group agrees (a collective on the control group: one all_gather of an int64). `groups`:
    the replicate groups (default: the whole world, DDP)."""
    mine = torch.tensor([replica_fingerprint(model)], dtype=torch.int64)
    if not ctx.distributed or ctx.world_size == 1:
        return None
    every = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine, group=ctx.control_group)
    values = [int(t) for t in every]
    return values if disagreeing(values, groups) else None


def disagreeing(values: list[int], groups: list[list[int]] | None = None) -> list[int]:
    """The ranks of the replicate groups whose members' fingerprints differ."""
    groups = groups or [list(range(len(values)))]
    return sorted(r for g in groups if len({values[m] for m in g}) > 1 for r in g)


def odd_ranks(values: list[int], groups: list[list[int]] | None = None) -> list[int] | None:
    """The ranks outside a strict majority of equal fingerprints in their replicate group;
    None when a group that disagrees has no such majority (two replicas, or no value held
    by more than half)."""
    odd: list[int] = []
    for g in groups or [list(range(len(values)))]:
        mine = [values[m] for m in g]
        if len(set(mine)) == 1:
            continue
        value, count = Counter(mine).most_common(1)[0]
        if count * 2 <= len(mine):
            return None
        odd += [m for m in g if values[m] != value]
    return sorted(odd)
