"""Train a small GPT with DDP, checkpointed and exactly resumable by resilient.

    torchrun --nproc-per-node 2 recipes/train_ddp.py --steps 200 --ckpt-dir /tmp/ckpt

Kill it at any point and launch the same command again: it continues from the last committed
checkpoint and ends with the same bits as an uninterrupted run. Lines marked # resilient are
all the integration there is.
"""

import torch
from common.cli import build_loader, device_for, parse_args, split_at, write_digest
from common.data import CharTokenizer
from common.model import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel as DDP

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
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
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
            if args.micro_batches:  # resilient: an OOM or an exception here is recovered in place
                split = split_at(args.splits, step)
                for mb in rt.micro_batches(x.to(device), y.to(device), model=model, split=split):
                    with mb:
                        _, loss = model(*mb.inputs)
                        loss = loss / accum if accum > 1 else loss  # weighted by samples
                        mb.backward(loss)
                        rt.observe(loss=loss)  # resilient: after mb.backward, which may retry
            else:
                _, loss = model(x.to(device), y.to(device))
                loss = loss / accum if accum > 1 else loss  # equal batches: weighted by samples
                rt.observe(loss=loss)  # resilient: before backward, its checks ride the all-reduce
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
