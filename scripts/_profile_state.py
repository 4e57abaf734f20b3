"""What profile_load.py and profile_save.py share: the state they save, and a cold cache."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from resilient.groups.groups import init_distributed


def drop_caches() -> bool:
    """Write back and drop the page cache; False where this process may not (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def fresh_page_cache(rank: int) -> bool:
    """drop_caches on rank 0 between two barriers (a collective): every rank's next read
    comes from the disk. Whether it could."""
    dist.barrier()
    dropped = drop_caches() if rank == 0 else True
    dist.barrier()
    return dropped


def fsdp_adamw_state(layers: int) -> TrainState:
    """`layers` x Linear(2048, 2048), each and the root under FSDP2, with AdamW state after
    one step: about 48 MiB a layer (85 layers: about 4 GiB, 21: about 1 GiB). Call inside
    an initialised process group."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*mods)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(torch.randn(8, 2048)).sum().backward()
    opt.step()  # optimizer state exists from here on
    return TrainState(model=model, optimizer=opt)


def start(layers: int, out: str) -> tuple[Any, TrainState, Path, CheckpointManager]:
    """(process group context, state, checkpoint root, manager with keep_last=1), the first
    checkpoint (step 1) saved."""
    warnings.filterwarnings("ignore")
    ctx = init_distributed(timeout_s=600, side_timeout_s=600)
    state = fsdp_adamw_state(layers)
    root = Path(out)
    mgr = CheckpointManager(
        CheckpointConfig(url=str(root), keep_last=1), process_group=ctx.checkpoint_group
    )
    mgr.save(state, 1, blocking=True)
    return ctx, state, root, mgr


def print_profile(prof: cProfile.Profile, top: int) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    print(out.getvalue())


def finish(mgr: CheckpointManager, root: Path, rank: int) -> None:
    """Close the manager, remove what was written, leave the process group."""
    mgr.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
