"""Per-sample randomness that a resume reproduces: each sample is drawn under RNG seeded from
(seed, epoch, index).

A random augmentation in a dataset's `__getitem__` draws from the RNG of the process that
fetches the sample. In the main process the runtime saves and restores that RNG with every
checkpoint. In a loader worker it cannot: a worker's RNG starts from the loader's base seed
when the worker starts, and a resumed loader starts fresh workers whose streams have not
advanced through the samples they drew before the stop, so the resumed epoch augments its
samples differently. Seeding each draw from the sample's own coordinates makes the result a
function of the sample, whatever process, worker count or world size draws it.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["SeededSamples"]

_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive indices apart


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample's draw, stable across processes and Python runs."""
    x = (seed * _MIX + epoch) * _MIX + index
    x ^= x >> 31
    return (x * _MIX) & 0x7FFF_FFFF_FFFF_FFFF


def _seed_all(s: int) -> None:
    # the CPU generator alone: torch.manual_seed also walks every device type (90 us a call)
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np.random.seed(s & 0xFFFF_FFFF)


class SeededSamples(Dataset):
    """`dataset` with each `__getitem__` run under torch, random and numpy RNG seeded from
    (seed, epoch, index), the process's own streams untouched. `set_epoch` reaches the
    loader's workers, persistent ones included, through a shared-memory counter."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch[0] = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        s = sample_seed(self.seed, int(self._epoch[0]), int(index))
        if torch.utils.data.get_worker_info() is not None:
            # a loader worker: its own streams are reseeded for every sample, nothing to keep
            _seed_all(s)
            return self.dataset[index]
        # the main process: its streams are the run's, saved in checkpoints; leave them be
        py, npy = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            _seed_all(s)
            try:
                return self.dataset[index]
            finally:
                random.setstate(py)
                np.random.set_state(npy)

    def __getattr__(self, name: str) -> Any:  # column names and the like: the dataset's
        if name in ("dataset", "seed", "_epoch"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
