"""Train a small GPT with FSDP2 (fully_shard), checkpointed and exactly resumable by resilient.

    torchrun --nproc-per-node 2 recipes/train_fsdp.py --steps 200 --ckpt-dir /tmp/ckpt

Checkpoints are sharded: each rank writes its own shard, and a checkpoint saved on N ranks
loads on M. Lines marked # resilient are all the integration there is.
"""

import torch
from common.cli import build_loader, device_for, parse_args, write_digest
from common.data import CharTokenizer
from common.model import GPT, GPTConfig
from torch.distributed.fsdp import fully_shard

import resilient


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rt = resilient.init(
        args.ckpt_dir,
        run_dir=args.run_dir,  # resilient
        save_every_steps=args.save_every,
        async_save=not args.sync_save,
    )
    device = device_for(rt.ctx.local_rank)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=CharTokenizer().vocab_size)).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loader = build_loader(args, rt.rank, rt.world_size)
    torch.manual_seed(args.seed + rt.rank)  # a different dropout stream per rank

    rt.track(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)  # resilient
    batches = rt.batches()  # resilient: resumable, epoch-aware iterator over the loader
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):  # resilient: resumes, saves
        accum = rt.grad_accum  # resilient: batches a step that keep the global batch (1 unless
        for _ in range(accum):  # the world changed: docs/operating.md#batch-policy)
            _, x, y = next(batches)
            _, loss = model(x.to(device), y.to(device))
            loss = loss / accum if accum > 1 else loss  # equal batches: weighted by samples
            rt.observe(loss=loss)  # resilient: fingerprints and loss-spike checks
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if rt.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    write_digest(rt, model, optimizer)
    rt.close()  # resilient


if __name__ == "__main__":
    main()
