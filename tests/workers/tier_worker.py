"""Worker of tests/test_s3.py: two checkpoint tiers (a local directory and S3) under torchrun.

Usage: tier_worker.py --url s3://bucket/prefix --tier-dir DIR --run-dir DIR --out DIR

FSDP2 on every rank, remote_every=3: saves after steps 1..4 land local, local, S3, local.
Loads the newest (local step 4), then rank 0 wipes the local directory (the node is lost)
and every rank loads again: S3's step 3. Each rank writes DIR/rank<R>.json with the digests
after each save and after each load.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from resilient import log
from resilient.checkpoint import CheckpointConfig, TrainState, open_manager, state_digest


def main() -> None:
    p = argparse.ArgumentParser()
    for arg in ("--url", "--tier-dir", "--run-dir", "--out"):
        p.add_argument(arg, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    pg = dist.new_group(backend="gloo")  # DCP's collectives on their own group
    rank = dist.get_rank()
    log.configure(run_dir=args.run_dir, run_id="tiers", rank=rank, restart=0, console_level="ERROR")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizer=opt)
    config = CheckpointConfig(
        url=args.url, local_url=args.tier_dir, remote_every=3, async_save=True, keep_last=5
    )
    mgr = open_manager(config, process_group=pg)
    mgr.check_writable()
    saved: dict[str, str] = {}
    loaded: list[tuple[int | None, str]] = []
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 5):
        loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        mgr.wait_staged()  # the async save must not see this step's update
        opt.step()
        mgr.save(state, step)
        saved[str(step)] = state_digest(model, opt)
    mgr.close()

    for wipe in (False, True):
        if wipe and rank == 0:
            shutil.rmtree(args.tier_dir)
        dist.barrier()
        with torch.no_grad():
            for p_ in model.parameters():
                p_.zero_()
        loader = open_manager(config, process_group=pg)
        loader.check_writable()
        loaded.append((loader.load_latest(state), state_digest(model, opt)))
        loader.close()

    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"saved": saved, "loaded": loaded}))
    dist.barrier()  # destroy alone aborted now and then (docs/internals.md#g-destroy-abort)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
