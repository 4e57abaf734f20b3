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
from resilient.checkpoint.state import state_digest
from resilient.errors import ConfigError
from resilient.runtime.dist import DistContext
from resilient.runtime.replica import BuddyReplicas, is_sharded, localize, rehydrate
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


def test_the_adaptive_interval_weighs_the_steps_a_replica_exchange_slows() -> None:
    """The interval's arithmetic on recorded step times (no processes): a copy of 1 ms
    against 100 ms steps is under the 2% budget, but an exchange that slows the step after
    each snapshot by 30 ms is not; an exchange cannot cost more than it lasted; where it
    slows nothing, every step again."""
    snaps = Snapshots(SnapshotConfig(enabled=True), CTX)
    snaps.sharded, snaps.replicas = True, BuddyReplicas(CTX)
    snaps._copy_s, snaps._step_s = [0.001] * 8, [0.100] * 8
    snaps._busy_s, snaps._spans = [0.130] * 4, [1] * 4  # every step so far: nothing to
    snaps._agree_interval()  # compare with yet
    assert snaps.every == 2
    snaps._step_s = [0.100] * 32
    snaps._clean_s = [0.100] * 16  # 30 ms per exchange: (1 + 30) / (0.02 * 100) = 15.5
    snaps._busy_s, snaps._spans = [0.130] * 16, [1] * 16
    snaps._agree_interval()
    assert snaps.every == 16
    snaps._exchange_wall = [0.010] * 16  # it ran for 10 ms only: (1 + 10) / 2 = 5.5
    snaps._agree_interval()
    assert snaps.every == 8
    snaps._exchange_wall = [0.001] * 16  # (1 + 1) / 2 = 1, but at most halved at a time
    snaps._agree_interval()
    assert snaps.every == 4
    snaps._agree_interval()
    assert snaps.every == 2
    snaps._busy_s = [0.100] * 16  # no longer slower than the others: the copy alone
    snaps._agree_interval()
    assert snaps.every == 1
    plain = Snapshots(SnapshotConfig(enabled=True), CTX)  # nothing replicated: the copy alone
    plain._copy_s, plain._step_s = [0.001] * 8, [0.1] * 8
    plain._agree_interval()
    assert plain.every == 1


def test_a_hot_re_run_goes_on_at_the_interval_it_had() -> None:
    """What a survivor carries over a hot re-run (hot.restart keeps interval_state, hot.resume
    gives it to adopt_interval): the new Snapshots starts at the interval the group had, with
    its measurements, and skips the early agreement four steps in (it would otherwise
    snapshot every step until then, and at 16 x the budget that is 4 steps at 16 x)."""
    t = Trainee(0)
    t.train(1, seed=1)
    old = Snapshots(SnapshotConfig(enabled=True), CTX)
    old.sharded, old.replicas = True, BuddyReplicas(CTX)
    old._step_s = old._clean_s = [0.100] * 16
    old._copy_s, old._busy_s, old._spans = [0.001] * 8, [0.130] * 16, [1] * 16
    old._agree_interval()
    assert old.every == 16
    carried = old.interval_state()
    new = Snapshots(SnapshotConfig(enabled=True), CTX)
    new.sharded, new.replicas = True, BuddyReplicas(CTX)
    new.track(t.state())
    new.adopt_interval(16, carried)
    assert new.every == 16 and new._busy_s == old._busy_s
    for step in range(40, 46):  # past the early agreement (start + 4): still 16, no snapshot
        new.after_step(step)
    assert new.every == 16 and new.held == []
    new.after_step(48)
    assert new.held == [48]
    # the replacement holds no measurements of its own: the interval alone
    fresh = Snapshots(SnapshotConfig(enabled=True), CTX)
    fresh.adopt_interval(16, None)
    assert fresh.every == 16 and fresh._step_s == []
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
    finally:
        dist.destroy_process_group()


def test_replicas_must_be_zero_or_one() -> None:
    with pytest.raises(ConfigError, match="replicas must be 0 or 1"):
        SnapshotConfig(enabled=True, replicas=2)
