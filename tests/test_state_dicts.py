"""The model and optimizer state dicts with DCP's names kept between saves
(resilient/checkpoint/_state_dicts.py): what is saved is what DCP's own calls give, bit for
bit, and a replaced parameter, an added param group or a replaced optimizer is saved as it is
now, never stale. Plain modules here; DDP and FSDP2 over 2 ranks at the end
(tests/workers/state_dicts_worker.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from trainee import Trainee

from resilient import CheckpointConfig, CheckpointManager, TrainState, state_digest
from resilient.checkpoint.manifest import step_dir

pytestmark = pytest.mark.timeout(120)


def manager(root: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("async_save", False)
    return CheckpointManager(CheckpointConfig(url=str(root), **kw))


def same(a: Any, b: Any) -> bool:
    """Equal structure, keys in the same order, tensors bitwise equal."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    return bool(a == b)


def files(root: Path, step: int) -> dict[str, str]:
    """sha256 of each DCP data file of a checkpoint."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / step_dir(step)).glob("*.distcp"))
    }


def load(root: Path, t: Trainee) -> int | None:
    return manager(root).load_latest(TrainState(model=t.model, optimizer=t.opt, rng=False))


def test_kept_names_give_what_dcp_gives_and_are_kept() -> None:
    t = Trainee(0)
    t.train(2)
    state = TrainState(model=t.model, optimizer=t.opt, rng=False)
    for _ in range(3):
        sd = state.to_state_dict(step=2, rank=0)
        assert same(sd["model"], get_model_state_dict(t.model))
        assert same(sd["optim"], get_optimizer_state_dict(t.model, t.opt))
        # the same live tensors as DCP hands out, not copies
        assert (
            sd["optim"]["state"]["0.weight"]["exp_avg"] is t.opt.state[t.model[0].weight]["exp_avg"]
        )
    assert state._dicts.kept
    assert not TrainState(model=t.model, optimizer=t.opt, keep_names=False)._dicts.kept


def test_a_state_dict_replaced_on_the_instance_is_never_kept(events: Any) -> None:
    t = Trainee(0)
    t.train(2)
    t.model.state_dict = lambda *a, **k: nn.Module.state_dict(t.model, *a, **k)
    state = TrainState(model=t.model, optimizer=t.opt, rng=False)
    for _ in range(2):
        sd = state.to_state_dict(step=2, rank=0)
        assert same(sd["model"], get_model_state_dict(t.model))
        assert same(sd["optim"], get_optimizer_state_dict(t.model, t.opt))
    assert not state._dicts.kept
    (event,) = events("ckpt.state_dict.uncached")  # once, not once per call
    assert event["reason"] == "state_dict replaced on the instance"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saved_files_are_bitwise_those_of_the_stock_path(tmp_path: Path, async_save: bool) -> None:
    t = Trainee(0)
    t.train(3)
    kept = TrainState(model=t.model, optimizer=t.opt, common={"scheduler": t.sched}, rng=False)
    stock = TrainState(
        model=t.model, optimizer=t.opt, common={"scheduler": t.sched}, rng=False, keep_names=False
    )
    kept.to_state_dict(step=0, rank=0)  # names resolved: the save below uses them
    assert kept._dicts.kept
    for state, root in ((kept, tmp_path / "kept"), (stock, tmp_path / "stock")):
        mgr = manager(root, async_save=async_save)
        mgr.save(state, 3)
        assert mgr.wait() == 3 or mgr.last_committed == 3
        mgr.close()
    assert files(tmp_path / "kept", 3) == files(tmp_path / "stock", 3)
    # .metadata names its own directory; the entries it lists are the same
    kept_md, stock_md = (
        FileSystemReader(str(tmp_path / d / step_dir(3))).read_metadata() for d in ("kept", "stock")
    )
    assert kept_md.state_dict_metadata == stock_md.state_dict_metadata
    b = Trainee(1)
    assert load(tmp_path / "kept", b) == 3
    assert b.digest() == t.digest()


def two_saves(
    tmp_path: Path, t: Trainee, state: TrainState, change: Any, *, async_save: bool
) -> str:
    """Save (names resolved), save (names kept), `change()`, train, save: the digest of what
    the last save should hold."""
    mgr = manager(tmp_path / "ckpt", async_save=async_save, keep_last=5)
    mgr.save(state, 1)
    mgr.save(state, 2)
    mgr.wait()
    assert state._dicts.kept
    change()
    t.train(1, seed=5)
    want = state_digest(t.model, state.optimizer)
    mgr.save(state, 3)
    mgr.wait()
    mgr.close()
    return want


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_replaced_parameter_is_saved_as_it_is_now(tmp_path: Path, async_save: bool) -> None:
    t = Trainee(0)
    t.train(2)
    state = TrainState(model=t.model, optimizer=t.opt, rng=False)

    def replace() -> None:
        old = t.model[0].weight
        new = nn.Parameter(torch.full_like(old, 0.25))
        t.model[0].weight = new
        for g in t.opt.param_groups:
            g["params"] = [new if p is old else p for p in g["params"]]
        t.opt.state[new] = {k: torch.full_like(v, 7.0) for k, v in t.opt.state.pop(old).items()}

    want = two_saves(tmp_path, t, state, replace, async_save=async_save)
    b = Trainee(1)
    assert load(tmp_path / "ckpt", b) == 3
    assert b.digest() == want
    assert torch.equal(b.model[0].weight, t.model[0].weight)
    assert not torch.equal(b.model[0].weight, torch.full_like(b.model[0].weight, 0.25))  # trained


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_added_param_group_is_saved(tmp_path: Path, async_save: bool) -> None:
    t = Trainee(0)
    first, rest = list(t.model[0].parameters()), list(t.model[2].parameters())
    t.opt = torch.optim.AdamW(first, lr=1e-2)
    t.sched = torch.optim.lr_scheduler.StepLR(t.opt, step_size=2)
    t.train(2)
    state = TrainState(model=t.model, optimizer=t.opt, rng=False)
    want = two_saves(
        tmp_path,
        t,
        state,
        lambda: t.opt.add_param_group({"params": rest, "lr": 0.5}),
        async_save=async_save,
    )
    b = Trainee(1)
    b.opt = torch.optim.AdamW(list(b.model[0].parameters()), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(b.opt, step_size=2)  # its initial_lr, as in `t`
    b.opt.add_param_group({"params": list(b.model[2].parameters()), "lr": 0.1})
    assert load(tmp_path / "ckpt", b) == 3
    assert b.digest() == want
    assert b.opt.param_groups[1]["lr"] == 0.5
    assert all(p in b.opt.state for p in b.model[2].parameters())  # the new group's moments


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_replaced_optimizer_is_saved(tmp_path: Path, async_save: bool) -> None:
    t = Trainee(0)
    t.train(2)
    state = TrainState(model=t.model, optimizer=t.opt, rng=False)

    def replace() -> None:
        t.opt = torch.optim.AdamW(t.model.parameters(), lr=0.125, betas=(0.5, 0.5))
        state.optimizer = t.opt
        t.sched = torch.optim.lr_scheduler.StepLR(t.opt, step_size=100)

    want = two_saves(tmp_path, t, state, replace, async_save=async_save)
    b = Trainee(1)
    assert load(tmp_path / "ckpt", b) == 3
    assert b.digest() == want
    assert b.opt.param_groups[0]["lr"] == 0.125 and b.opt.param_groups[0]["betas"] == (0.5, 0.5)
    assert all(int(s["step"]) == 1 for s in b.opt.state.values())  # one step of the new one


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_and_fsdp2_over_two_ranks(tmp_path: Path, torchrun: Any) -> None:
    rc, stdout, stderr = torchrun(2, "state_dicts_worker.py", str(tmp_path), timeout=200)
    assert rc == 0, f"{stdout[-2000:]}\n{stderr[-8000:]}"
    for r in range(2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        for how in ("ddp", "fsdp"):
            assert rec[how]["checks"] == "ok", (r, how, rec[how])
