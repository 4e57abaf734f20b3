"""A small GPT training loop using resilient's guards: the workload of the hang/guard tests.

    python -m chaos.inject --fault oom@rank=1,step=3,phase=forward -- \
        tests/workers/guarded_train.py --mode micro --ckpt-dir C --run-dir R

--mode micro: rt.micro_batches (DDP retries an OOM in place); guard: `with rt.guard()`;
none: the bare loop. The final state digest goes to <run-dir>/final_digest.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient
from recipes.common.cli import build_loader, write_digest
from recipes.common.data import CharTokenizer
from recipes.common.model import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--mode", choices=["micro", "guard", "none"], default="micro")
    p.add_argument(
        "--splits",
        default="",
        help="least micro-batches per step: 'STEP:SPLIT,...', each from its step on",
    )
    p.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    p.add_argument("--eval", action="store_true", help="an (empty) eval phase every step")
    p.add_argument(
        "--metric", action="store_true", help="all_reduce the loss after each step, unguarded"
    )
    p.add_argument(
        "--comm-hook",
        action="store_true",
        help="register torch's Python all-reduce comm hook on the DDP model",
    )
    p.add_argument(
        "--nan-at",
        type=int,
        default=None,
        help="rank 0's loss is NaN at this step (gradients not finite by themselves); every "
        "rank then skips the optimizer step, as a GradScaler would",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument(
        "--save-every-seconds", type=float, default=None, help="a time policy instead of steps"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-chars", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    schedule = [tuple(int(v) for v in item.split(":")) for item in args.splits.split(",") if item]

    timed = args.save_every_seconds is not None
    rt = resilient.init(
        args.ckpt_dir,
        run_dir=args.run_dir,
        save_every_steps=None if timed else args.save_every,
        save_every_seconds=args.save_every_seconds,
        async_save=False,
    )
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=CharTokenizer().vocab_size, n_layer=1, n_head=2, n_embd=32)
    model: torch.nn.Module = GPT(cfg)
    if args.fsdp:
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    elif rt.world_size > 1:
        model = DDP(model)
        if args.comm_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = build_loader(args, rt.rank, rt.world_size)
    torch.manual_seed(args.seed + rt.rank)

    rt.track(model=model, optimizer=optimizer, loader=loader)
    batches = rt.batches()
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):
        _, x, y = next(batches)
        if args.mode == "micro":
            split = None
            for first, k in schedule:  # splits only grow: micro_batches keeps the largest
                if first <= step:
                    split = k
            for mb in rt.micro_batches(x, y, model=model, split=split):
                with mb:
                    _, loss = model(*mb.inputs)
                    if step == args.nan_at and rt.rank == 0:
                        loss = loss * float("nan")
                    mb.backward(loss)
        elif args.mode == "guard":
            with rt.guard():
                _, loss = model(x, y)
                loss.backward()
        else:
            _, loss = model(x, y)
            loss.backward()
        if step != args.nan_at:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.eval:
            with rt.phase("eval"):
                pass
        if args.metric:  # a user's own collective outside any guard, as loss logging does
            dist.all_reduce(loss.detach().clone())

    write_digest(rt, model, optimizer)
    rt.close()


if __name__ == "__main__":
    main()
