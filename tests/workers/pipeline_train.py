"""Worker of tests/test_pipeline.py: a pipeline-parallel loop on torch.distributed.pipelining.

One `nn.Sequential` of 4 `nn.Linear` layers split over `--pp` stages (GPipe or 1F1B), times
`--dp` data-parallel replicas of each stage (DDP over the mesh's "dp" dimension), on a
("dp", "pp") DeviceMesh passed to `track()`. Each stage keeps the whole model's module names
and holds only its own layers (the others are `nn.Identity()`), so a checkpoint holds every
layer under its global name. `--pp 1` runs the same model unsplit, with the same micro-batches.

Bad input on purpose: `--local-names` names each stage's layers 0.., as a naive split does
(the save must be refused); `--no-mesh` keeps global names but passes no mesh, as torch's
pipelining tutorial does (the stages' names are disjoint: refused at track(), before step
0); `--layers N` builds a model of N layers (a checkpoint of 4 loaded into 3: the missing
layer named); `--split-of-rank R`
gives rank R another split (refused at track()); `--uneven` leaves a --microbatches that does
not divide --batch to the runtime (refused in the first step's forwards).

Each rank appends one JSON line per completed step to <record>/rank<R>.jsonl (step, stage,
sample ids, the loss on the last stage) and, at the end, <record>/final_rank<R>.json with a
sha256 of its stage's model and optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import resilient

WIDTH = 16


class Pairs(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.randn(n, WIDTH, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def build(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def split(model: nn.Sequential, stage: int, stages: int, *, local_names: bool) -> nn.Module:
    """Stage `stage`'s part: the whole model with the other stages' layers replaced by
    nn.Identity (global names), or (`local_names`) its own layers renumbered from 0."""
    n = len(model)
    lo, hi = stage * n // stages, (stage + 1) * n // stages
    if local_names:
        return nn.Sequential(*[model[i] for i in range(lo, hi)])
    for i in range(n):
        if not lo <= i < hi:
            model[i] = nn.Identity()
    return model


def interleave(model: nn.Sequential, rank: int, pp: int) -> list[tuple[int, nn.Module]]:
    """Interleaved stages: 2 x pp virtual stages, rank r running r and r + pp. The model keeps
    its global names (the other ranks' layers become nn.Identity) and is what is tracked;
    each virtual stage runs an nn.Sequential over its own layers (the same parameters)."""
    n, v = len(model), 2 * pp
    mine = {c: range(c * n // v, (c + 1) * n // v) for c in (rank, rank + pp)}
    owned = {i for r in mine.values() for i in r}
    for i in range(n):
        if i not in owned:
            model[i] = nn.Identity()
    return [(c, nn.Sequential(*[model[i] for i in r])) for c, r in mine.items()]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + _bytes(v))
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{i}.{k}".encode() + _bytes(v))
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="per data-parallel rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--record", required=True)
    p.add_argument("--local-names", action="store_true")
    p.add_argument("--no-mesh", action="store_true")
    p.add_argument("--split-of-rank", type=int, default=None)
    p.add_argument("--uneven", action="store_true", help="skip the micro-batch check here")
    args = p.parse_args()

    rt = resilient.init(save_every_steps=args.save_every, async_save=True)
    if args.batch % args.microbatches and not args.uneven:
        raise resilient.ConfigError(
            f"--batch {args.batch} is not a multiple of --microbatches {args.microbatches}"
        )
    mesh = init_device_mesh("cpu", (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    stage, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    model: nn.Module = build(args.layers)
    chunks: list[tuple[int, nn.Module]] = []  # interleaved: (virtual stage, its module)
    if args.pp > 1 and args.schedule == "interleaved":
        assert isinstance(model, nn.Sequential)
        chunks = interleave(model, stage, args.pp)
    elif args.pp > 1:
        shift = 1 if rt.rank == args.split_of_rank else 0  # bad input: another split
        assert isinstance(model, nn.Sequential)
        model = split(model, min(stage + shift, args.pp - 1), args.pp, local_names=args.local_names)
    if args.dp > 1:
        model = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = Pairs()
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=args.dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True
    )
    loader = StatefulDataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    rt.track(model=model, optimizer=opt, loader=loader, mesh=None if args.no_mesh else mesh)

    loss_fn = nn.MSELoss()
    last = stage == args.pp - 1
    sched = None
    if chunks:  # two virtual stages on each rank, the tracked model holding both
        stages = [
            PipelineStage(m, v, 2 * args.pp, torch.device("cpu"), group=mesh.get_group("pp"))
            for v, m in chunks
        ]
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    elif args.pp > 1:
        pp_stage = PipelineStage(
            model, stage, args.pp, torch.device("cpu"), group=mesh.get_group("pp")
        )
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        sched = kind(pp_stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    batches = rt.batches()
    os.makedirs(args.record, exist_ok=True)
    rec = open(os.path.join(args.record, f"rank{rt.rank}.jsonl"), "a")  # noqa: SIM115
    attempt = f"{rt.ctx.run_id}/{os.environ.get('RESILIENT_ATTEMPT', rt.ctx.restart)}"
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):
        idx, x, y = next(batches)
        loss: torch.Tensor | None = None
        if sched is None:  # unsplit: the same micro-batches, the same mean of their losses
            losses = []
            for xm, ym in zip(x.chunk(args.microbatches), y.chunk(args.microbatches), strict=True):
                mb = loss_fn(model(xm), ym)
                (mb / args.microbatches).backward()
                losses.append(mb.detach())
            loss = torch.stack(losses).mean()
        elif stage == 0:
            sched.step(x)
        elif last:
            out: list[torch.Tensor] = []
            sched.step(target=y, losses=out)
            loss = torch.stack(out).mean()
        else:
            sched.step()
        rt.observe(loss=loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        line = {
            "attempt": attempt,
            "rank": rt.rank,
            "stage": stage,
            "dp_rank": dp_rank,
            "step": step,
            "ids": [int(i) for i in idx],
            "loss": None if loss is None else float(loss),
            "digest": digest(model, opt)[:16],  # after the update: where two runs part
            "t": time.time(),
        }
        rec.write(json.dumps(line) + "\n")
        rec.flush()
    with open(os.path.join(args.record, f"final_rank{rt.rank}.json"), "w") as f:
        json.dump({"step": rt.step, "stage": stage, "digest": digest(model, opt)}, f)
    rt.close()


if __name__ == "__main__":
    main()
