"""An endless, resumable iterator over a StatefulDataLoader, epoch by epoch."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ResumableBatches"]


class ResumableBatches:
    """Iterates a loader forever; its state is (epoch, loader position).

    The sampler's state is only its position in the epoch, so the epoch is saved here
    (TORCH_NOTES gotcha 5) and handed to `set_epoch` for reshuffling. Creating an iterator
    draws from the global torch RNG; doing it under fork_rng keeps a resumed run's RNG
    stream identical to an uninterrupted one.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = 0
        self._it: Any = None

    def _set_epoch(self) -> None:
        for obj in (
            getattr(self.loader, "sampler", None),
            getattr(getattr(self.loader, "batch_sampler", None), "sampler", None),
        ):
            set_epoch = getattr(obj, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)

    def __iter__(self) -> ResumableBatches:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # at most one epoch rollover per batch
            if self._it is None:
                self._set_epoch()
                with torch.random.fork_rng(devices=[]):
                    self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self.epoch += 1
                self._it = None
        raise RuntimeError("the tracked loader yields no batches: is its dataset empty?")

    def state_dict(self) -> dict[str, Any]:
        # No iterator yet (start, or just past an epoch's end): the next epoch starts afresh.
        # The loader's own state would describe the finished epoch instead.
        return {
            "epoch": self.epoch,
            "loader": self.loader.state_dict() if self._it is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self._it = None
        if state["loader"] is not None:
            self._set_epoch()
            self.loader.load_state_dict(state["loader"])
