"""An endless, resumable iterator over a StatefulDataLoader, epoch by epoch.

Besides the loader's own state (exact resume on the same world size), it keeps the data
position in a form that survives a world-size change: the epoch and the number of samples
consumed in it by all ranks together. With a DistributedSampler, rank r of W takes samples
perm[r], perm[r + W], ... of the epoch's permutation, so after each rank took k samples the
ranks together consumed exactly perm[0 : k*W], whatever W was. A new world W' continues at
perm[k*W :] by telling each rank's sampler it already yielded k*W / W' samples: no sample is
skipped or seen twice (see resilient/data/position.py).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

__all__ = ["ResumableBatches"]


class ResumableBatches:
    """Iterates a loader forever; its state is (epoch, loader position).

    The sampler's state is only its position in the epoch, so the epoch is saved here
    (docs/internals.md#g-loader-rng) and handed to `set_epoch` for reshuffling. Creating an iterator
    draws from the global torch RNG; doing it under fork_rng keeps a resumed run's RNG
    stream identical to an uninterrupted one.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = 0
        self._it: Any = None
        self._start = 0
        """Samples this rank's sampler had yielded when the current iterator began."""
        self._taken = 0
        """Batches handed out by the current iterator."""
        self._generator_state: torch.Tensor | None = None
        """The loader's generator as saved, to restore once a resumed iterator has begun."""
        self._pending_loader: dict[str, Any] | None = None
        """The loader state loaded but not yet resumed (no batch drawn since the load)."""
        self._micro: int | None = None
        """The batch size the batch sampler was set to (batch policy "exact"), if another."""
        self.drawn = 0
        """Batches handed out by this process (never saved): DataPosition counts them a step."""
        self.iter_started_at: float | None = None
        """Wall time the main thread entered `iter(loader)`, which forks the workers; None
        outside (data/worker_start.py names a worker stuck in its fork meanwhile)."""

    @property
    def batch_size(self) -> int | None:
        """Samples per batch this loader yields now: its own batch_size, or the micro-batch
        size the batch policy set (set_batch_size)."""
        own = getattr(self.loader, "batch_size", None)
        return self._micro or (int(own) if own else None)

    def set_batch_size(self, size: int) -> bool:
        """Make the loader's batch sampler yield `size` samples a batch from its next
        iterator on (the sampler's order is untouched). False when it cannot: no batch
        sampler with a batch_size."""
        sampler = getattr(self.loader, "batch_sampler", None)
        if sampler is None or not isinstance(getattr(sampler, "batch_size", None), int):
            return False
        sampler.batch_size = size
        own = getattr(self.loader, "batch_size", None)
        self._micro = None if size == own else size
        return True

    def _samplers(self) -> list[Any]:
        return [
            obj
            for obj in (
                getattr(self.loader, "sampler", None),
                getattr(getattr(self.loader, "batch_sampler", None), "sampler", None),
            )
            if obj is not None
        ]

    def _set_epoch(self) -> None:
        for obj in self._samplers():
            set_epoch = getattr(obj, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)

    def __iter__(self) -> ResumableBatches:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # at most one epoch rollover per batch
            try:
                return self.next_in_epoch()
            except StopIteration:
                continue
        raise RuntimeError("the tracked loader yields no batches: is its dataset empty?")

    def next_in_epoch(self) -> Any:
        """The next batch of the current epoch; at its end StopIteration, with `epoch`
        advanced to the next one."""
        if self._it is None:
            self._set_epoch()
            self.iter_started_at = time.time()
            try:
                with torch.random.fork_rng(devices=[]):
                    self._it = iter(self.loader)
            finally:
                self.iter_started_at = None
            self._pending_loader = None  # the iterator now carries it
        try:
            batch = next(self._it)
        except StopIteration:
            self._restore_generator()
            self.end_epoch()
            raise
        self._restore_generator()
        self._taken += 1
        self.drawn += 1
        return batch

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.loader, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def _restore_generator(self) -> None:
        # A StatefulDataLoader with `generator=` shares it between the base seed that each
        # iterator draws and RandomSampler's permutation, but saves its state from before the
        # base seed was drawn: a resumed iterator leaves it one draw off, and the next epoch
        # is shuffled differently. Its state as saved is where it must be.
        gen, state = self._generator(), self._generator_state
        if gen is not None and state is not None:
            gen.set_state(state)
        self._generator_state = None

    def taken_in_epoch(self) -> int:
        """Batches this rank took from the current epoch so far (after a resume, those of
        the stopped run included)."""
        batch_size = getattr(self.loader, "batch_size", None)
        return (self._start // batch_size if batch_size else self._start) + self._taken

    def end_epoch(self) -> None:
        """Leave the current epoch (whatever is left of it); the next batch starts the next."""
        if self._it is None and self._pending_loader is not None:
            # A loaded position left before a batch was drawn from it: a save at an epoch's
            # last step, resumed by a framework that starts the next epoch itself. The
            # loader would resume the finished epoch at its next iterator (an empty one).
            self.drop_loaded_state()
            self._restore_generator()
        self.epoch += 1
        self._it = None
        self._pending_loader = None
        self._start = self._taken = 0

    def state_dict(self) -> dict[str, Any]:
        # No iterator yet (start, or just past an epoch's end): the next epoch starts afresh
        # (at `start` after a reshard). The loader's own state would describe the finished
        # epoch instead. Loaded but not yet resumed (a snapshot or save right after a
        # resume, before the first batch): the state as loaded, since the next batch resumes
        # from it; without this a rollback to that snapshot would restart the epoch.
        gen = self._generator()
        if self._it is not None:
            loader = self.loader.state_dict()
        else:
            loader = copy.deepcopy(self._pending_loader)
        generator: torch.Tensor | None
        if self._generator_state is not None:  # not yet put back into the generator
            generator = self._generator_state.clone()
        else:
            generator = gen.get_state() if gen is not None else None
        return {
            "epoch": self.epoch,
            "loader": loader,
            "start": self._start,
            "taken": self._taken,
            "generator": generator,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self._it = None
        self._start = int(state.get("start", 0))
        self._taken = int(state.get("taken", 0))
        self._generator_state = state.get("generator")
        if state["loader"] is None:
            self._restore_generator()  # no iterator to resume: it applies from here on
        self._pending_loader = state["loader"]
        if state["loader"] is not None:
            self._set_epoch()
            self.loader.load_state_dict(state["loader"])
        elif self._start:
            self._seek_sampler(self._start)

    # ------------------------------------------------------------------ world-size changes
    def sampler(self) -> Any:
        """The loader's DistributedSampler (repositionable or not), or None."""
        from torch.utils.data.distributed import DistributedSampler

        for obj in self._samplers():
            if isinstance(obj, DistributedSampler):
                return obj
        return None

    def _distributed_sampler(self) -> Any:
        """The loader's DistributedSampler if it can be repositioned, else None."""
        from torch.utils.data.distributed import DistributedSampler

        for obj in self._samplers():
            if isinstance(obj, DistributedSampler) and hasattr(obj, "load_state_dict"):
                return obj
        return None

    def last_batch(self) -> dict[str, Any]:
        """Where the batch taken last comes from, for reports that name a batch: its epoch,
        its index in that epoch on this rank, and its dataset indices ("samples") where the
        loader can tell: a DistributedSampler, whose order is a pure function of its epoch and
        seed, and a fixed batch_size. Computed when asked (a fault), never per step."""
        from torch.utils.data.distributed import DistributedSampler

        batch_size = self.batch_size
        first = self._start // batch_size if batch_size else self._start
        out: dict[str, Any] = {"epoch": self.epoch, "batch": first + self._taken - 1}
        sampler = self._distributed_sampler()
        if sampler is not None and batch_size and self._taken > 0:
            # the base class's order: the stateful sampler's own __iter__ would skip and count
            order = list(DistributedSampler.__iter__(sampler))
            at = self._start + (self._taken - 1) * int(batch_size)
            out["samples"] = [int(i) for i in order[at : at + int(batch_size)]]
        return out

    def global_position(self) -> tuple[int, int] | None:
        """(epoch, samples all ranks consumed in it), or None when the loader cannot tell
        (no repositionable DistributedSampler, or no fixed batch_size)."""
        sampler = self._distributed_sampler()
        batch_size = self.batch_size
        if sampler is None or not batch_size:
            return None
        per_rank = self._start + self._taken * int(batch_size)
        return self.epoch, per_rank * int(sampler.num_replicas)

    def seek(self, epoch: int, consumed: int) -> None:
        """Continue epoch `epoch` after `consumed` samples taken by all ranks together, on this
        loader's world size. Raises ValueError when that cannot be done exactly."""
        sampler = self._distributed_sampler()
        if sampler is None:
            raise ValueError(
                "the loader has no DistributedSampler with load_state_dict (use torchdata's "
                "StatefulDistributedSampler): its position cannot move to a new world size"
            )
        world = int(sampler.num_replicas)
        if consumed % world:
            raise ValueError(f"{consumed} samples consumed do not split evenly over {world} ranks")
        self.epoch = int(epoch)
        self._it = None
        self._pending_loader = None
        self._start, self._taken = consumed // world, 0
        self._seek_sampler(self._start)

    def drop_loaded_state(self) -> None:
        """Forget the loader state loaded from a checkpoint (a StatefulDataLoader resumes it at
        its next iterator): after `seek`, when that state was saved with another batch size."""
        if getattr(self.loader, "next_iter_state", None) is not None:
            self.loader.next_iter_state = None

    def _seek_sampler(self, per_rank: int) -> None:
        sampler = self._distributed_sampler()
        if sampler is None:
            raise ValueError("the loader's sampler cannot be repositioned")
        self._set_epoch()
        sampler.load_state_dict({"yielded": per_rank})
