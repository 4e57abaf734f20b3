"""The DDP recipe's loop with every rank on one GPU, for scripts/gpu_runs.py's hot replacement.

    resilient run --hot-recovery --nproc-per-node 2 scripts/gpu_hot_worker.py --micro-batches \
        --steps 24 --save-every 4 --ckpt-dir C --run-dir R

recipes/train_ddp.py puts rank r on cuda:r with NCCL, so on a host with one GPU it runs one
rank. A hot replacement needs two: a survivor that holds the state and a rank that is lost.
Here every rank trains on cuda:0 and the training group is gloo (CUDA tensors over gloo:
NCCL refuses two ranks on one device), with the recipe's model, data, flags and digest.
`--device cpu` runs the same on the CPU (a smoke test where no GPU is).
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient
from recipes.common.cli import build_loader, device_for, parse_args, split_at, write_digest
from recipes.common.data import CharTokenizer
from recipes.common.model import GPT, GPTConfig

_set_device = torch.cuda.set_device


def one_gpu() -> None:
    """Every rank on cuda:0: init_distributed pins cuda:<local rank>, which a host with one
    GPU has for local rank 0 only. (A hot generation runs this script again: once is
    enough.)"""
    if getattr(torch.cuda.set_device, "one_gpu", False):
        return

    def set_device(device: torch.device | str | int | None) -> None:
        _set_device(0)

    set_device.one_gpu = True  # type: ignore[attr-defined]
    torch.cuda.set_device = set_device


def more(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], more)
    if args.device == "cuda":
        one_gpu()
    rt = resilient.init(
        args.ckpt_dir,
        run_dir=args.run_dir,
        save_every_steps=args.save_every,
        async_save=not args.sync_save,
        backend="gloo",  # the training group too: every rank's tensors on the one GPU
    )
    # cuda:0 with deterministic kernels (the recipes' own choice), or the CPU
    device = device_for(0) if args.device == "cuda" else torch.device("cpu")

    torch.manual_seed(args.seed)  # same initial weights on every rank
    net = GPT(GPTConfig(vocab_size=CharTokenizer().vocab_size)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loader = build_loader(args, rt.rank, rt.world_size)
    torch.manual_seed(args.seed + rt.rank)  # a different dropout stream per rank

    rt.track(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    batches = rt.batches()
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):
        _, x, y = next(batches)
        if args.micro_batches:  # a lost peer is seen in the guard, as in the recipe
            split = split_at(args.splits, step)
            for mb in rt.micro_batches(x.to(device), y.to(device), model=model, split=split):
                with mb:
                    _, loss = model(*mb.inputs)
                    mb.backward(loss)
                    rt.observe(loss=loss)
        else:
            _, loss = model(x.to(device), y.to(device))
            rt.observe(loss=loss)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if rt.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    write_digest(rt, model, optimizer)
    rt.close()


if __name__ == "__main__":
    main()
