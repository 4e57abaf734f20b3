"""Where a verified checkpoint load's time goes: cProfile of rank 0's `load_latest`.

    .venv/bin/torchrun --nproc-per-node 2 scripts/profile_load.py --layers 85 --out DIR

Saves FSDP2 + AdamW state of `--layers` x Linear(2048, 2048) on 2 ranks (85 layers: about
4 GiB, 21: about 1 GiB) to DIR, then loads it `--reps` times, the page cache dropped before
each (root only; otherwise the loads read from the cache, and the script says so). Prints
each load's seconds, then rank 0's profile of the last one (cumulative time, top 45).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from resilient.runtime.dist import init_distributed


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="where the checkpoint is written (removed)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    ctx = init_distributed(timeout_s=600, side_timeout_s=600)
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(args.layers):
        mods += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*mods)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(torch.randn(8, 2048)).sum().backward()
    opt.step()  # optimizer state exists from here on
    state = TrainState(model=model, optimizer=opt)
    root = Path(args.out)
    mgr = CheckpointManager(
        CheckpointConfig(url=str(root), keep_last=1), process_group=ctx.checkpoint_group
    )
    mgr.save(state, 1, blocking=True)
    dropped = True
    for rep in range(args.reps):
        dist.barrier()
        if ctx.rank == 0:
            dropped = _drop_caches()
        dist.barrier()
        prof = cProfile.Profile() if rep == args.reps - 1 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        assert mgr.load_latest(state) == 1
        if prof is not None:
            prof.disable()
        print(f"rank {ctx.rank} load {time.perf_counter() - t0:.3f} s", flush=True)
        if prof is not None and ctx.rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
            print(out.getvalue())
    if ctx.rank == 0:
        print("page cache dropped before each load:", "yes" if dropped else "NO (not root)")
    mgr.close()
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
