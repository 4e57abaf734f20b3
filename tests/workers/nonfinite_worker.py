"""Worker of tests/test_numeric_ckpt.py: 2 ranks, FSDP2, where only rank 1's shard turns NaN.

Usage (under torchrun): nonfinite_worker.py --ckpt DIR --out DIR --run-dir DIR
Each rank saves step 1 (async: committed), then rank 1 alone writes a NaN into its local
shard of the first layer's weight, and every rank tries an async save of step 2 and a
blocking save of step 3. Each rank writes DIR/rank<R>.json: what each save raised and what
the manager says was committed.
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
from torch.distributed.fsdp import fully_shard

from resilient import log
from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState


def outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    pg = dist.new_group(backend="gloo")  # the manager's own group, as the runtime gives it
    rank = dist.get_rank()
    log.configure(run_dir=args.run_dir, run_id="nonfinite", rank=rank, restart=0,
                  console_level="ERROR")  # fmt: skip

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 13)).pow(2).mean().backward()
    opt.step()
    state = TrainState(model=model, optimizer=opt)
    mgr = CheckpointManager(CheckpointConfig(url=args.ckpt, keep_last=1), process_group=pg)
    record: dict[str, Any] = {"rank": rank}
    mgr.save(state, 1)
    record["step1"] = mgr.wait()
    weight = model[0].weight
    record["sharded"] = type(weight).__name__
    if rank == 1:
        with torch.no_grad():
            weight.to_local()[0, 0] = float("nan")
    mgr.save(state, 2)
    record["async"] = outcome(mgr.wait)
    record["blocking"] = outcome(lambda: mgr.save(state, 3, blocking=True))
    record["candidates"] = mgr.candidates()
    record["last_committed"] = mgr.last_committed
    mgr.close()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    dist.barrier()  # destroy alone aborted now and then (docs/internals.md#g-destroy-abort)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
