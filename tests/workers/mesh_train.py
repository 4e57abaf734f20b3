"""Worker of tests/test_mesh.py: a tiny model on a ("dp_replicate", "dp_shard", "tp") mesh,
FSDP2 (HSDP when dp_replicate > 1) over the data-parallel dimensions and tensor parallel
(colwise then rowwise) over "tp", launched by `resilient run`.

Each rank appends one JSON line per completed step to <record>/rank<R>.jsonl: the step, the
world size, the data-parallel degree and coordinate, the micro-batches per step and the
sample ids it consumed, so tests can check that tp peers drew the same batch and that no
sample is skipped or seen twice across restarts and mesh changes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import resilient
from recipes.common.data import build_dataset


class Tiny(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.fc = nn.Linear(16, 64)
        self.proj = nn.Linear(64, 16)
        self.out = nn.Linear(16, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.proj(F.gelu(self.fc(h)))
        logits = self.out(h)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="per-rank micro-batch size")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--record", required=True)
    p.add_argument("--sampler-by-world", action="store_true", help="bad input: split by world")
    p.add_argument("--mesh-names", default="dp_replicate,dp_shard,tp")
    args = p.parse_args()

    rt = resilient.init(save_every_steps=args.save_every, async_save=True)
    names = tuple(args.mesh_names.split(","))
    mesh = init_device_mesh(
        "cpu", (args.dp_replicate, args.dp_shard, args.tp), mesh_dim_names=names
    )
    dp_rank = mesh.get_local_rank(names[0]) * args.dp_shard + mesh.get_local_rank(names[1])
    dataset, tok = build_dataset(block_size=16, num_chars=40_000, seed=0)
    torch.manual_seed(0)
    model = Tiny(tok.vocab_size)
    if args.tp > 1:
        parallelize_module(
            model, mesh[names[2]], {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
        )
    fully_shard(model, mesh=mesh[names[0], names[1]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replicas = rt.world_size if args.sampler_by_world else args.dp_replicate * args.dp_shard
    sampler = StatefulDistributedSampler(
        dataset,
        num_replicas=replicas,
        rank=rt.rank if args.sampler_by_world else dp_rank,
        shuffle=True,
        seed=0,
        drop_last=True,
    )
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    rt.track(model=model, optimizer=opt, loader=loader, global_batch_size=args.global_batch)
    batches = rt.batches()
    os.makedirs(args.record, exist_ok=True)
    rec = open(os.path.join(args.record, f"rank{rt.rank}.jsonl"), "a")  # noqa: SIM115
    attempt = f"{rt.ctx.run_id}/{os.environ.get('RESILIENT_ATTEMPT', rt.ctx.restart)}"
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):
        ids: list[int] = []
        accum = rt.grad_accum
        for _ in range(accum):
            idx, x, y = next(batches)
            loss = model(x, y) / accum
            loss.backward()
            ids += [int(i) for i in idx]
        rt.observe(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        line = {
            "attempt": attempt,
            "rank": rt.rank,
            "world": rt.world_size,
            "dp": rt.layout.dp_degree,
            "dp_rank": dp_rank,
            "accum": accum,
            "step": step,
            "ids": ids,
            "t": time.time(),
        }
        rec.write(json.dumps(line) + "\n")
        rec.flush()
    digest = resilient.state_digest(model, opt)
    if rt.rank == 0:
        with open(os.path.join(args.record, "final.json"), "w") as f:
            json.dump({"step": rt.step, "world": rt.world_size, "digest": digest}, f)
    rt.close()


if __name__ == "__main__":
    main()
