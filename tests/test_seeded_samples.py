"""Per-sample randomness that a resume reproduces (resilient/data/seeded.py): a random
augmentation in __getitem__, drawn in loader workers, gives a resumed epoch the same samples
as an uninterrupted one, with any number of workers. Without it the resumed workers' RNG
starts afresh and the samples differ, which is what the wrapper is for."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilient.data.seeded import SeededSamples, sample_seed


class _Augmented(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 1_000_000, ()))])


def _loader(dataset: Dataset, workers: int) -> StatefulDataLoader:
    torch.manual_seed(7)  # the loader's base seed for its workers
    return StatefulDataLoader(dataset, batch_size=4, num_workers=workers, shuffle=False)


def _epoch(dataset: Dataset, workers: int, *, resume_after: int | None = None) -> list:
    loader = _loader(dataset, workers)
    it = iter(loader)
    if resume_after is None:
        return [b.tolist() for b in it]
    head = [next(it).tolist() for _ in range(resume_after)]
    state = loader.state_dict()
    del it
    fresh = _loader(dataset, workers)
    fresh.load_state_dict(state)
    return head + [b.tolist() for b in fresh]


@pytest.mark.timeout(120)
def test_a_resumed_epoch_draws_the_same_augmentations_in_workers() -> None:
    seeded = SeededSamples(_Augmented(), seed=3)
    straight = _epoch(seeded, workers=2)
    assert _epoch(seeded, workers=2, resume_after=5) == straight
    assert _epoch(seeded, workers=0) == straight  # and with no workers at all
    plain = _Augmented()
    assert _epoch(plain, workers=2, resume_after=5) != _epoch(plain, workers=2)


@pytest.mark.timeout(60)
def test_each_epoch_draws_anew_and_the_process_stream_is_untouched() -> None:
    seeded = SeededSamples(_Augmented(), seed=3)
    first = [seeded[i].tolist() for i in range(4)]
    before = torch.get_rng_state()
    assert [seeded[i].tolist() for i in range(4)] == first
    assert torch.equal(torch.get_rng_state(), before)
    seeded.set_epoch(1)
    assert [seeded[i].tolist() for i in range(4)] != first
    assert len({sample_seed(3, e, i) for e in range(4) for i in range(1000)}) == 4000
