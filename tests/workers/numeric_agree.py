"""Worker of tests/test_numeric.py: how many messages the numeric check's agreement costs.

Usage (under torchrun, 2 ranks): numeric_agree.py --out DIR
A small DDP model and one FSDP2 model, each with a NumericWatch (spike detection on, a window
of 3) on a control group that counts every collective made on it. Per variant, 8 steps: the
loss observed before its backward (DDP), after it (DDP), and FSDP2; at step 6 rank 0's loss
is scaled by 1000 (a spike). Each rank writes DIR/rank<R>.json: per variant, the collectives
of the quiet steps, the fault's step, ranks and what each saw, and whether the spiked step
changed a weight.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient.numeric.config import NumericConfig
from resilient.numeric.detect import NumericWatch

SPIKE_AT = 6


class Ctx:
    """What NumericWatch reads of a DistContext, counting uses of its control group (every
    collective the watch makes names it)."""

    def __init__(self, group: Any) -> None:
        self.distributed, self.rank = True, dist.get_rank()
        self.world_size = dist.get_world_size()
        self._group, self.uses = group, 0

    @property
    def control_group(self) -> Any:
        self.uses += 1
        return self._group


def run(variant: str, model: nn.Module, ctx: Ctx) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = NumericWatch(NumericConfig(spike_factor=5.0, spike_window=3), ctx)  # type: ignore[arg-type]
    watch.attach(opt, replicated=variant != "fsdp2")
    g = torch.Generator().manual_seed(dist.get_rank())
    quiet, faults, changed = [], [], None
    for step in range(8):
        x = torch.randn(4, 8, generator=g)
        before = [p.detach().clone() for p in model.parameters()]
        ctx.uses = 0
        watch.begin(step)
        loss = model(x).pow(2).mean() + 1.0
        if step == SPIKE_AT and dist.get_rank() == 0:
            loss = loss * 1000
        if variant != "ddp_observed_late":
            watch.observe_loss(loss)
        loss.backward()
        if variant == "ddp_observed_late":
            watch.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        fault = watch.end_step()
        if fault is None:
            quiet.append(ctx.uses)
        else:
            faults.append({"step": fault.step, "ranks": fault.ranks, "seen": fault.seen})
            after = list(model.parameters())
            changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"quiet_collectives": quiet, "faults": faults, "spiked_step_changed": changed}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    ctx = Ctx(dist.new_group(backend="gloo"))
    torch.manual_seed(0)
    result = {
        "ddp_observed_first": run("ddp_observed_first", DDP(nn.Linear(8, 8)), ctx),
        "ddp_observed_late": run("ddp_observed_late", DDP(nn.Linear(8, 8)), ctx),
        "fsdp2": run("fsdp2", fully_shard(nn.Sequential(nn.Linear(8, 8))), ctx),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
