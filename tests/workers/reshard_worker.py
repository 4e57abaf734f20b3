"""Worker of tests/test_reshard.py: save or load a tiny model under FSDP2, DDP or no wrapper.

Usage (under torchrun, or as a plain process for "plain"):
    reshard_worker.py --out DIR --run-dir DIR OP [OP ...]
where OP is `save:<fsdp|ddp|plain>:<checkpoint dir>`, `load:<fsdp|ddp|plain>:<checkpoint dir>`
or `weights:<fsdp|ddp|plain>:<source>` (resilient.load_model of the model alone: a checkpoint
location, a safetensors directory or a torch.save file; `model_digest` is the model's).
Each rank writes DIR/rank<R>.json: one record per OP with the state digest (the same on every
rank: state_digest gathers the full state) and the scheduler state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resilient import log
from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState, state_digest

SAVE_STEP = 3


def build(seed: int, how: str) -> nn.Module:
    """Uneven widths: with 4 ranks FSDP2 shards 7 rows as 2/2/2/1 and 3 rows as 1/1/1/0."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    elif how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif how != "plain":
        raise SystemExit(f"unknown wrapper {how!r}")
    return model


def optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def run_op(op: str, rank: int, pg: Any) -> dict[str, Any]:
    kind, how, url = op.split(":", 2)
    model = build(0 if kind == "save" else 1, how)
    if kind == "weights":
        from resilient.weights.load import load_model

        loaded = load_model(url, model, process_group=pg)
        digest = state_digest(model)
        return {"op": op, "digest": digest, "model_digest": digest, "keys": loaded.keys}
    opt, sched = optimizer(model)
    state = TrainState(model=model, optimizer=opt, common={"scheduler": sched})
    mgr = CheckpointManager(CheckpointConfig(url=url, async_save=False), process_group=pg)
    record: dict[str, Any] = {"op": op, "world_size": mgr.world_size}
    if kind == "save":
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(SAVE_STEP):
            loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        mgr.save(state, SAVE_STEP)
        record["step"] = mgr.last_committed
    else:
        record["digest_before"] = state_digest(model, opt)
        record["step"] = mgr.load_latest(state)
    mgr.close()
    record["digest"] = state_digest(model, opt)
    record["model_digest"] = state_digest(model)
    record["scheduler"] = {
        k: v for k, v in sched.state_dict().items() if k != "_get_lr_called_within_step"
    }
    record["lr"] = opt.param_groups[0]["lr"]
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("ops", nargs="+")
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        # DCP's collectives get their own gloo group, as the runtime does.
        pg = dist.new_group(backend="gloo")
        rank = dist.get_rank()
    else:
        pg, rank = None, 0
    log.configure(
        run_dir=args.run_dir, run_id="reshard", rank=rank, restart=0, console_level="ERROR"
    )
    records = [run_op(op, rank, pg) for op in args.ops]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(records, indent=1))
    if distributed:
        dist.barrier()  # destroy alone aborted now and then (docs/internals.md#g-destroy-abort)
        dist.destroy_process_group()
        # gloo's teardown still aborted once after the barrier, with the results written;
        # this worker tests the load, so it leaves without the interpreter's finalization
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
