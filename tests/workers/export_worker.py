"""Worker of tests/test_export.py: train a small model under FSDP2, DDP or no wrapper, save
checkpoints at steps 1 and 2, and record the full state each one holds.

Usage (under torchrun, or as a plain process for "plain"):
    export_worker.py --out DIR OP [OP ...]
where OP is `<fsdp|ddp|plain>:<checkpoint dir>`. For each OP, rank 0 writes
`<checkpoint dir>.expected.pt`: {step: {"model": full model state dict, "optim": full
optimizer state dict}} as get_model_state_dict / get_optimizer_state_dict give them with
full_state_dict=True.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from resilient import log
from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState


class Net(nn.Module):
    """Uneven widths (FSDP2 on 4 ranks shards 7 rows as 2/2/2/1, 3 rows as 1/1/1/0) and an
    integer buffer, the same on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 5))
        self.head = nn.Linear(5, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.head(self.body(self.emb(idx)))


def build(how: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.emb, model.body[0], model.body[2], model.head):
            fully_shard(layer)
        fully_shard(model)
    elif how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif how != "plain":
        raise SystemExit(f"unknown wrapper {how!r}")
    return model


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies: on a CPU model the state dicts hold the live tensors, which training changes."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, opt, options=opts),
        }
    )


def run_op(op: str, rank: int, pg: Any) -> None:
    how, url = op.split(":", 1)
    model = build(how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mgr = CheckpointManager(CheckpointConfig(url=url, async_save=False), process_group=pg)
    g = torch.Generator().manual_seed(100 + rank)
    expected = {}
    for step in (1, 2):
        loss = model(torch.randint(11, (4,), generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.save(TrainState(model=model, optimizer=opt), step)
        expected[step] = full_state(model, opt)  # a collective: every rank
    mgr.close()
    if rank == 0:
        torch.save(expected, f"{url}.expected.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("ops", nargs="+")
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        pg = dist.new_group(backend="gloo")  # DCP's collectives on a group of their own
        rank = dist.get_rank()
    else:
        pg, rank = None, 0
    log.configure(run_dir=args.run_dir, run_id="export", rank=rank, restart=0,
                  console_level="ERROR")  # fmt: skip
    for op in args.ops:
        run_op(op, rank, pg)
    if distributed:
        dist.barrier()  # destroy alone aborted now and then (docs/internals.md#g-destroy-abort)
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # gloo's teardown aborted now and then, after the results were written


if __name__ == "__main__":
    sys.exit(main())
