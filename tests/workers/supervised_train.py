"""Worker of tests/test_supervisor.py, test_preempt.py and test_elastic.py: a tiny DDP model
on the recipes' dataset, launched by `resilient run`.

Each rank appends one JSON line per completed step to <record>/rank<R>.jsonl: the step, the
world size, the micro-batches per step and the sample ids it consumed (the dataset yields
(idx, x, y)), so tests can check that no sample is skipped or seen twice across restarts and
world-size changes. --crash-step/--crash-rank raise on that rank at that step (in every
attempt, or only in the first with --crash-once).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import resilient
from recipes.common.data import build_dataset


class Tiny(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.out = nn.Linear(16, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.emb(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--sync", action="store_true", help="synchronous saves")
    p.add_argument("--batch", type=int, default=4, help="per-rank micro-batch size")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--record", required=True)
    p.add_argument("--crash-step", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--crash-once", action="store_true")
    p.add_argument("--extra-mb", type=int, default=0, help="extra checkpointed state (MB)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--watchdog", default=None, help="JSON overrides of the watchdog config")
    p.add_argument("--preempt", default=None, help="JSON overrides of the preempt config")
    p.add_argument(
        "--linger", default=None, help="RANK:SECONDS: that rank sleeps at its exit, whatever it is"
    )
    args = p.parse_args()

    options: dict = {"save_every_steps": args.save_every, "async_save": not args.sync}
    if args.watchdog:
        options["watchdog"] = json.loads(args.watchdog)
    if args.preempt:
        options["preempt"] = json.loads(args.preempt)
    rt = resilient.init(**options)
    if args.linger:
        rank, seconds = args.linger.split(":")
        if int(rank) == rt.rank:
            atexit.register(time.sleep, float(seconds))
    dataset, tok = build_dataset(block_size=16, num_chars=40_000, seed=0)
    torch.manual_seed(0)
    model: nn.Module = Tiny(tok.vocab_size)
    if args.extra_mb:
        model.register_buffer("ballast", torch.zeros(args.extra_mb * (1 << 18)))
    if rt.ctx.distributed:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=0, drop_last=True
    )
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        drop_last=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(0),
    )
    rt.track(model=model, optimizer=opt, loader=loader, global_batch_size=args.global_batch)
    batches = rt.batches()
    os.makedirs(args.record, exist_ok=True)
    rec = open(os.path.join(args.record, f"rank{rt.rank}.jsonl"), "a")  # noqa: SIM115
    attempt = os.environ.get("RESILIENT_ATTEMPT", str(rt.ctx.restart))
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):
        ids: list[int] = []
        accum = rt.grad_accum
        for _ in range(accum):
            idx, x, y = next(batches)
            loss = model(x, y) / accum
            loss.backward()
            ids += [int(i) for i in idx]
        crash = args.crash_step == step and args.crash_rank == rt.rank
        if crash and (not args.crash_once or rt.ctx.restart == 0):
            raise RuntimeError(f"injected failure at step {step}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.write(
            json.dumps(
                {
                    "attempt": attempt,
                    "rank": rt.rank,
                    "world": rt.world_size,
                    "accum": accum,
                    "step": step,
                    "ids": ids,
                    "t": time.time(),
                }
            )
            + "\n"
        )
        rec.flush()
        if args.sleep:
            time.sleep(args.sleep)
    digest = resilient.state_digest(model, opt)
    if rt.rank == 0:
        with open(os.path.join(args.record, "final.json"), "w") as f:
            json.dump({"step": rt.step, "world": rt.world_size, "digest": digest}, f)
    rt.close()


if __name__ == "__main__":
    main()
