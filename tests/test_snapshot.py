"""In-memory snapshots in one process: the memory check at track(), the two buffers, and a
restore that puts back exactly the state of the snapshot's step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from resilient.checkpoint._torch_compat import no_init_step
from resilient.checkpoint.state import TrainState, state_digest
from resilient.errors import ConfigError
from resilient.groups.groups import DistContext
from resilient.memory.interval import MAX_EVERY, Measurements, wanted_interval
from resilient.memory.replica import BuddyReplicas, is_sharded, localize, rehydrate
from resilient.memory.snapshot import SnapshotConfig, Snapshots, StepCounter
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


def test_the_adaptive_interval_weighs_the_steps_a_replica_exchange_slows() -> None:
    """The interval's arithmetic on recorded step times (pure, no processes): a copy of 1 ms
    against 100 ms steps is under the 2% budget, but an exchange that slows the step after
    each snapshot by 30 ms is not; an exchange cannot cost more than it lasted; where it
    slows nothing, every step again."""
    m = Measurements(copy_s=[0.001] * 8, step_s=[0.100] * 8)
    m.busy_s, m.spans = [0.130] * 4, [1] * 4  # every step so far: nothing to compare with yet

    def want(current: int) -> int:
        return wanted_interval(m, budget=0.02, current=current, replicating=True)[0]

    assert want(1) == 2
    m.step_s = [0.100] * 32
    m.clean_s = [0.100] * 16  # 30 ms per exchange: (1 + 30) / (0.02 * 100) = 15.5
    m.busy_s, m.spans = [0.130] * 16, [1] * 16
    assert want(2) == 16
    m.exchange_wall = [0.010] * 16  # it ran for 10 ms only: (1 + 10) / 2 = 5.5
    assert want(16) == 8
    m.exchange_wall = [0.001] * 16  # (1 + 1) / 2 = 1, but at most halved at a time
    assert want(8) == 4
    assert want(4) == 2
    m.busy_s = [0.100] * 16  # no longer slower than the others: the copy alone
    assert want(2) == 1
    plain = Measurements(copy_s=[0.001] * 8, step_s=[0.1] * 8)  # nothing replicated
    assert wanted_interval(plain, budget=0.02, current=1, replicating=False) == (1, 0.0)
    huge = Measurements(copy_s=[10.0], step_s=[0.001])  # never past the cap
    assert wanted_interval(huge, budget=0.02, current=1, replicating=False)[0] == MAX_EVERY


def test_the_snapshots_agree_the_interval_they_want() -> None:
    """Snapshots takes what wanted_interval says (one process: MAX over itself)."""
    snaps = Snapshots(SnapshotConfig(enabled=True), CTX, replicas=BuddyReplicas(CTX))
    snaps.sharded = True
    snaps.measured = Measurements(
        copy_s=[0.001] * 8, step_s=[0.1] * 32, clean_s=[0.1] * 16, busy_s=[0.13] * 16
    )
    snaps.measured.spans = [1] * 16
    snaps._agree_interval()
    assert snaps.every == 16


def test_a_hot_re_run_goes_on_at_the_interval_it_had() -> None:
    """What a survivor carries over a hot re-run (HotRecovery.restart keeps interval_state,
    the hot resume gives it to adopt_interval): the new Snapshots starts at the interval the
    group had, with its measurements, and skips the early agreement four steps in (it would
    otherwise snapshot every step until then, and at 16 x the budget that is 4 steps at
    16 x)."""
    t = Trainee(0)
    t.train(1, seed=1)
    old = Snapshots(SnapshotConfig(enabled=True), CTX, replicas=BuddyReplicas(CTX))
    old.sharded = True
    old.measured = Measurements(step_s=[0.100] * 16, clean_s=[0.100] * 16, copy_s=[0.001] * 8)
    old.measured.busy_s, old.measured.spans = [0.130] * 16, [1] * 16
    old._agree_interval()
    assert old.every == 16
    carried = old.interval_state()
    new = Snapshots(SnapshotConfig(enabled=True), CTX, replicas=BuddyReplicas(CTX))
    new.sharded = True
    new.track(t.state())
    new.adopt_interval(16, carried)
    assert new.every == 16 and new.measured.busy_s == old.measured.busy_s
    for step in range(40, 46):  # past the early agreement (start + 4): still 16, no snapshot
        new.after_step(step)
    assert new.every == 16 and new.held == []
    new.after_step(48)
    assert new.held == [48]
    # the replacement holds no measurements of its own: the interval alone
    fresh = Snapshots(SnapshotConfig(enabled=True), CTX)
    fresh.adopt_interval(16, None)
    assert fresh.every == 16 and fresh.measured.step_s == []
    # a fixed interval is the user's: nothing to adopt
    fixed = Snapshots(SnapshotConfig(enabled=True, every_steps=2), CTX)
    fixed.adopt_interval(16, carried)
    assert fixed.every == 2


def test_step_counter_rewinds() -> None:
    c = StepCounter(2, 6)
    seen = []
    for s in c:
        seen.append(s)
        if s == 4 and seen.count(4) == 1:
            c.rewind(3)
    assert seen == [2, 3, 4, 3, 4, 5]


def test_a_shard_crosses_to_a_new_mesh_bit_for_bit_and_a_misfit_is_refused(
    tmp_path: Path,
) -> None:
    """What a hot recovery carries of FSDP2 state: shards without their mesh (localize), made
    DTensors again on the new model's mesh (rehydrate). One real gloo rank."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:

        def build() -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            fully_shard(m)
            return m, torch.optim.AdamW(m.parameters(), lr=0.1)

        old, opt = build()
        old(torch.randn(4, 8)).sum().backward()
        opt.step()
        sd = {"model": get_model_state_dict(old), "optim": get_optimizer_state_dict(old, opt)}
        shards = localize(sd)
        flat = [v for v in shards["model"].values()] + [
            t for s in shards["optim"]["state"].values() for t in s.values()
        ]
        assert not any(isinstance(v, DTensor) for v in flat)
        assert is_sharded(shards)

        new, opt2 = build()
        back = rehydrate(shards, new)
        assert all(isinstance(v, DTensor) for v in back["model"].values())
        set_model_state_dict(new, back["model"])
        with no_init_step(opt2):
            set_optimizer_state_dict(new, opt2, back["optim"])
        assert state_digest(new, opt2) == state_digest(old, opt)

        name = next(iter(shards["model"]))
        wrong = {**shards, "model": dict(shards["model"])}
        wrong["model"][name] = {**shards["model"][name]}
        wrong["model"][name]["__resilient_shard__"] = torch.zeros(1)
        with pytest.raises(ValueError, match="a different sharding"):
            rehydrate(wrong, new)
        wrong["model"][name] = {**shards["model"][name], "shape": (3, 3)}
        with pytest.raises(ValueError, match="global shape"):
            rehydrate(wrong, new)
        with pytest.raises(ValueError, match="no sharded parameter"):
            rehydrate(shards, nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))

        # the whole state as TrainState saves and applies it, in both optimizer formats
        # (flat: per parameter, what a pipeline stage of FSDP2 shards saves)
        for flat in (False, True):
            saved = TrainState(model=old, optimizer=opt, pipeline=flat)
            shards = localize(saved.to_state_dict(step=1, rank=0))
            new, opt2 = build()
            TrainState(model=new, optimizer=opt2, pipeline=flat).apply(
                rehydrate(shards, new), rank=0
            )
            assert state_digest(new, opt2) == state_digest(old, opt), flat
    finally:
        dist.destroy_process_group()


def test_replicas_must_be_zero_or_one() -> None:
    with pytest.raises(ConfigError, match="replicas must be 0 or 1"):
        SnapshotConfig(enabled=True, replicas=2)
