"""Worker of tests/test_state_dicts.py: DCP's names kept between saves, under DDP and FSDP2.

Usage (under torchrun): state_dicts_worker.py OUT_DIR. For each wrapper, each rank checks
that the state dicts with kept names are DCP's own (keys in order, every local shard bitwise),
that a save through them writes the very files the stock path writes, and that an added param
group and a replaced optimizer are saved as they are now (loaded back: the same full-state
digest). Writes OUT_DIR/rank<R>.json: {"ddp": {"checks": "ok" or the failure}, "fsdp": ...}.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from reshard_worker import build  # the same small model, DDP or FSDP2
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState, state_digest
from resilient.checkpoint.manifest import step_dir


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return (
            type(a) is type(b)
            and getattr(a, "placements", None) == getattr(b, "placements", None)
            and a.shape == b.shape
            and bool(torch.equal(local(a), local(b)))
        )
    return bool(a == b)


def files(root: Path, step: int) -> dict[str, str]:
    d = root / step_dir(step)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.distcp"))}


def check(how: str, out: Path) -> None:
    pg = dist.new_group(backend="gloo")
    model = build(0, how)
    layers = [list(model.parameters())[:2], list(model.parameters())[2:]]
    opt: torch.optim.Optimizer = torch.optim.AdamW(layers[0], lr=1e-2)
    train(model, opt, 2, seed=1)

    def mgr(root: Path) -> CheckpointManager:
        return CheckpointManager(CheckpointConfig(url=str(root), keep_last=5), process_group=pg)

    kept = TrainState(model=model, optimizer=opt, rng=False)
    stock = TrainState(model=model, optimizer=opt, rng=False, keep_names=False)
    for _ in range(2):  # the second call uses the kept names
        sd = kept.to_state_dict(step=2, rank=dist.get_rank())
        assert same(sd["model"], get_model_state_dict(model)), "model state dict"
        assert same(sd["optim"], get_optimizer_state_dict(model, opt)), "optimizer state dict"
    assert kept._dicts.kept, "names not kept"

    # bitwise the files of the stock path, sync and async
    for async_save in (False, True):
        roots = [out / how / f"{name}-{async_save}" for name in ("kept", "stock")]
        for state, root in zip((kept, stock), roots, strict=True):
            m = mgr(root)
            m.save(state, 2, blocking=not async_save)
            m.wait()
            m.close()
        assert files(roots[0], 2) == files(roots[1], 2), f"files differ (async={async_save})"

    # an added param group, then a replaced optimizer: saved as they are now
    m = mgr(out / how / "changes")
    m.save(kept, 2)
    opt.add_param_group({"params": layers[1], "lr": 0.5})
    train(model, opt, 1, seed=2)
    want_group = state_digest(model, opt)
    m.save(kept, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.125)
    kept.optimizer = opt
    train(model, opt, 1, seed=3)
    want_new = state_digest(model, opt)
    m.save(kept, 4)
    m.close()
    assert kept._dicts.kept

    fresh = build(1, how)
    fopt = torch.optim.AdamW(list(fresh.parameters())[:2], lr=1e-2)
    fopt.add_param_group({"params": list(fresh.parameters())[2:], "lr": 0.1})
    assert mgr(out / how / "changes").try_load(TrainState(model=fresh, optimizer=fopt), 3)
    assert state_digest(fresh, fopt) == want_group, "added param group not saved"
    assert fopt.param_groups[1]["lr"] == 0.5
    fresh = build(2, how)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert mgr(out / how / "changes").try_load(TrainState(model=fresh, optimizer=fopt), 4)
    assert state_digest(fresh, fopt) == want_new, "replaced optimizer not saved"
    assert fopt.param_groups[0]["lr"] == 0.125


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict[str, Any] = {}
    for how in ("ddp", "fsdp"):
        try:
            check(how, out)
            record[how] = {"checks": "ok"}
        except Exception as e:
            record[how] = {"checks": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
