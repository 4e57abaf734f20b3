"""Worker of tests/test_numeric.py: how many messages the numeric check's agreement costs.

Usage (under torchrun, 3 ranks): numeric_agree.py --out DIR
Small DDP models and one FSDP2 model, each with a NumericWatch (spike detection on, a window
of 3) on a control group that counts every collective made on it. Per variant, 9 steps: the
loss observed before its backward (DDP), after it (DDP), and FSDP2; at step 6 rank 0's loss is
scaled by 1000 (a spike); at step 8 rank 1's first layer gets a NaN gradient under a finite
loss. A twin of the first model without a watch takes the same steps beside it (skipping the
faulty ones): the screen must leave every gradient bit as it was, so their weights stay
equal. Each rank writes DIR/rank<R>.json: per variant, the collectives of the quiet steps,
each fault's step, ranks and what each saw, whether a faulty step changed a weight, and
whether the twins' weights stayed equal.
"""

from __future__ import annotations

import argparse
import json
import math
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
NAN_GRAD_AT = 8


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


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def run(variant: str, model: nn.Module, ctx: Ctx, twin: nn.Module | None = None) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1) if twin is not None else None
    watch = NumericWatch(NumericConfig(spike_factor=5.0, spike_window=3), ctx)  # type: ignore[arg-type]
    watch.attach(opt, replicated=variant != "fsdp2")
    inner = model.module if isinstance(model, DDP) else model
    inner[0].register_forward_hook(poison)
    g = torch.Generator().manual_seed(dist.get_rank())
    quiet, faults, changed, equal = [], [], [], []
    for step in range(9):
        x = torch.randn(4, 8, generator=g)
        before = [p.detach().clone() for p in model.parameters()]
        ctx.uses = 0
        watch.begin(step)
        POISON[0] = step == NAN_GRAD_AT and dist.get_rank() == 1
        loss = model(x).pow(2).mean() + 1.0
        if step == SPIKE_AT and dist.get_rank() == 0:
            loss = loss * 1000
        if variant != "ddp_observed_late":
            watch.observe_loss(loss)
        loss.backward()
        if variant == "ddp_observed_late":
            watch.observe_loss(loss)
        if twin is not None:
            (twin(x).pow(2).mean() + 1.0).backward()
        opt.step()  # the watch screens the gradients first
        opt.zero_grad(set_to_none=True)
        fault = watch.end_step()
        if twin is not None and twin_opt is not None:
            if fault is not None:  # the watched model skipped it: so does its twin
                twin_opt.zero_grad(set_to_none=True)
            twin_opt.step()
            twin_opt.zero_grad(set_to_none=True)
            equal.append(
                all(
                    torch.equal(a, b)
                    for a, b in zip(model.parameters(), twin.parameters(), strict=True)
                )
            )
        if fault is None:
            quiet.append(ctx.uses)
        else:
            faults.append({"step": fault.step, "ranks": fault.ranks, "seen": fault.seen})
            after = list(model.parameters())
            changed.append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    return {
        "quiet_collectives": quiet,
        "faults": faults,
        "faulty_steps_changed": changed,
        "twin_equal": equal,
    }


POISON = [False]
"""Set for the step where rank 1's first layer gets a NaN gradient (its loss stays finite)."""


def poison(_module: nn.Module, _args: Any, out: torch.Tensor) -> None:
    if POISON[0]:
        out.register_hook(lambda grad: grad * math.nan)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    ctx = Ctx(dist.new_group(backend="gloo"))
    result = {
        "ddp_observed_first": run("ddp_observed_first", DDP(model()), ctx, twin=DDP(model())),
        "ddp_observed_late": run("ddp_observed_late", DDP(model()), ctx),
        "fsdp2": run("fsdp2", fully_shard(model()), ctx),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
