"""The collectives checkpoint managers agree with, on the process group they are given.

One helper, shared by CheckpointManager and TieredCheckpointManager (and DCP's load, through
the verifier): broadcast from rank 0, all-gather, and `agree`, which runs a function on rank 0
and hands every rank its result or its exception. In one process (no torch.distributed, or a
group of one) each is a plain call. The group must not be the training group: async saves run
these from a background thread while training runs its own collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["Collectives"]

T = TypeVar("T")


class Collectives:
    """Object collectives over `process_group` (None: the default group), or local calls."""

    def __init__(self, process_group: Any = None) -> None:
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        """This process's global rank (DCP and the file names use it)."""
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_all(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 and give every rank its result, or raise its exception."""
        result: tuple[bool, Any] = (True, None)
        if self.rank == 0:
            try:
                result = (True, fn())
            except Exception as e:  # shipped to every rank and re-raised there
                result = (False, e)
        ok, value = self.broadcast(result)
        if not ok:
            raise value
        return value
