"""Worker of scripts/bench_recovery.py: an MLP of a chosen width trained with DDP under
`resilient run`. Appends {"attempt", "rank", "step", "t"} per completed step to
<record>/rank<R>.jsonl, and with --agree N first times N back-to-back preemption checks.
--micro runs the step through rt.micro_batches (the guard's in-place agreement, which an
in-place rollback needs); --fault SPEC arms a chaos fault (chaos/faults.py) in this process;
--fsdp shards the model with FSDP2 instead of DDP."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--agree", type=int, default=0, help="time this many preemption checks")
    p.add_argument("--record", required=True)
    p.add_argument("--micro", action="store_true", help="the step through rt.micro_batches")
    p.add_argument("--fault", action="append", default=[], help="a chaos fault spec")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (each rank one shard) for DDP")
    args = p.parse_args()
    if args.fault:
        from chaos.faults import install, parse

        install([parse(f) for f in args.fault])

    rt = resilient.init(save_every_steps=args.save_every, async_save=not args.sync)
    torch.manual_seed(0)
    w = args.width
    model: nn.Module = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w))
    if args.fsdp:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif rt.ctx.distributed:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rt.track(model=model, optimizer=opt)
    os.makedirs(args.record, exist_ok=True)
    rec = open(os.path.join(args.record, f"rank{rt.rank}.jsonl"), "a")  # noqa: SIM115
    attempt = os.environ.get("RESILIENT_ATTEMPT", "0")
    if args.agree and rt.ctx.restart == 0:
        if rt.ctx.distributed:
            dist.barrier(group=rt.ctx.control_group)
        t0 = time.perf_counter()
        for _ in range(args.agree):
            rt.preemption.agree(force=True)
        us = 1e6 * (time.perf_counter() - t0) / args.agree
        rec.write(json.dumps({"rank": rt.rank, "agree_us": us}) + "\n")
    g = torch.Generator().manual_seed(rt.rank)
    for step in rt.steps(total=args.steps):
        t0 = time.perf_counter()
        x = torch.randn(8, w, generator=g)
        if args.micro:
            for mb in rt.micro_batches(x, model=model):
                with mb:
                    mb.backward(model(*mb.inputs).pow(2).mean())
        else:
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        compute = time.perf_counter() - t0
        rec.write(
            json.dumps(
                {"attempt": attempt, "rank": rt.rank, "step": step, "t": time.time(), "s": compute}
            )
            + "\n"
        )
        rec.flush()
        if args.sleep:
            time.sleep(args.sleep)
    rt.close()


if __name__ == "__main__":
    main()
