"""In-memory snapshots in one process: the memory check at track(), the two buffers, and a
restore that puts back exactly the state of the snapshot's step."""

from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.runtime.dist import DistContext
from resilient.runtime.snapshot import SnapshotConfig, Snapshots, StepCounter
from tests.trainee import Trainee

CTX = DistContext(rank=0, world_size=1, local_rank=0, restart=0, run_id="t", host="h", backend=None)


def test_not_enough_memory_for_two_copies_is_a_clear_error_at_track() -> None:
    snaps = Snapshots(SnapshotConfig(enabled=True, memory_fraction=1e-9), CTX)
    with pytest.raises(ConfigError, match=r"two copies of .* MiB.*available") as e:
        snaps.track(Trainee(0).state())
    assert "turn snapshots off" in str(e.value)


def test_rollback_restores_the_snapshot_bit_for_bit_and_the_buffers_stay_intact() -> None:
    t = Trainee(0)
    snaps = Snapshots(SnapshotConfig(enabled=True, every_steps=1), CTX)
    snaps.track(t.state())
    snaps.take(0)
    assert snaps.held == []  # no optimizer state yet: DCP would have to run a step to make it
    t.train(3, seed=1)
    snaps.take(3)
    at3 = t.digest()
    t.train(1, seed=2)
    snaps.take(4)
    assert snaps.held == [3, 4]
    t.train(2, seed=3)
    assert snaps.agree_rollback(step=6, failed_rank=0)
    assert snaps.pending == 4  # the newest held
    snaps.pending = 3  # (what ranks holding only step 3 in common would agree on)
    assert snaps.roll_back() == 3 and t.digest() == at3
    t.train(2, seed=4)  # the live state moves on; the buffer must not move with it
    snaps.pending = 3
    assert snaps.roll_back() == 3 and t.digest() == at3
    # a second failure of the same rank at the same step is refused: the cold path
    assert not snaps.agree_rollback(step=6, failed_rank=0)
    assert snaps.pending is None


def test_step_counter_rewinds() -> None:
    c = StepCounter(2, 6)
    seen = []
    for s in c:
        seen.append(s)
        if s == 4 and seen.count(4) == 1:
            c.rewind(3)
    assert seen == [2, 3, 4, 3, 4, 5]
