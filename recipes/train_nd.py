"""Train a small GPT on a device mesh: FSDP2 or HSDP, tensor parallel, pipeline stages.

    torchrun --nproc-per-node 4 recipes/train_nd.py --dp-shard 2 --tp 2 --ckpt-dir /tmp/ckpt
    torchrun --nproc-per-node 4 recipes/train_nd.py --dp-replicate 2 --dp-shard 2 --tp 1 ...
    torchrun --nproc-per-node 4 recipes/train_nd.py --pp 2 --dp-shard 2 --schedule 1f1b ...

The world mesh is ("dp_replicate", "dp_shard", "tp"), with "pp" outermost when `--pp` > 1;
`--dp-shard -1` (the default) takes the ranks the others leave. `--pp N` splits the blocks
over N stages (torch.distributed.pipelining, GPipe or 1F1B over `--microbatches` per batch):
each stage keeps the model's names and holds only its own layers (GPTStage), the loss exists
on the last stage, and the stages' shapes are given to PipelineStage, so no shape inference
runs a forward (it would draw dropout masks in the first step of every process).
Tensor parallel splits each block's attention by heads (q, k and v
column-wise, the output projection row-wise) and its MLP (fc column-wise, proj row-wise);
fully_shard then shards over the data-parallel dimensions (HSDP when dp-replicate > 1).
The loader is split over the data-parallel degree at the data-parallel coordinate, so tp
peers draw the same batch; dropout is seeded by that coordinate, so tp peers draw the same
masks on the activations they share. Each step runs `rt.grad_accum` micro-batches: a restart
on a smaller data-parallel degree keeps the global batch. Lines marked # resilient are all
the integration there is; docs/porting.md walks through it.
"""

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from common.cli import SampleLog, build_loader, device_for, parse_args, write_digest
from common.data import CharTokenizer
from common.model import GPT, GPTConfig, GPTStage
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import resilient

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def mesh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (1: FSDP2)")
    p.add_argument("--dp-shard", type=int, default=-1, help="FSDP shards; -1: the rest")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the outermost dim)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--microbatches", type=int, default=4, help="per batch, with --pp > 1")
    p.add_argument(
        "--layers", type=int, default=None, help="transformer blocks (default: 2, or --pp)"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step (default: --batch-size x the data-parallel degree); "
        "a multiple of it runs that many micro-batches per step",
    )


def build_mesh(args: argparse.Namespace, world_size: int) -> DeviceMesh:
    rep, tp, pp = args.dp_replicate, args.tp, args.pp
    shard = args.dp_shard if args.dp_shard > 0 else world_size // max(1, rep * tp * pp)
    if pp * rep * shard * tp != world_size:
        raise SystemExit(
            f"--pp {pp} x --dp-replicate {rep} x --dp-shard {args.dp_shard} x --tp {tp} does "
            f"not make {world_size} ranks: make their product the world size (or --dp-shard -1)"
        )
    cfg = GPTConfig()
    if cfg.n_head % tp or 4 * cfg.n_embd % tp:
        raise SystemExit(f"--tp {tp} must divide the model's {cfg.n_head} heads")
    if pp > 1 and tp > 1:
        raise SystemExit("--pp with --tp is not supported by this recipe: use --tp 1")
    args.layers = args.layers or max(2, pp)  # one block per stage at least
    if pp > args.layers:
        raise SystemExit(f"--pp {pp} needs at least as many --layers (got {args.layers})")
    if pp > 1 and args.batch_size % args.microbatches:
        raise SystemExit(
            f"--microbatches {args.microbatches} does not divide --batch-size "
            f"{args.batch_size}: the schedule would split the batch unevenly"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if pp > 1:
        return init_device_mesh(device, (pp, rep, shard, tp), mesh_dim_names=("pp", *MESH_DIMS))
    return init_device_mesh(device, (rep, shard, tp), mesh_dim_names=MESH_DIMS)


def parallelize(model: GPT, mesh: DeviceMesh) -> None:
    """Tensor parallel over "tp" (whole heads per rank), then FSDP2 over the data dimensions."""
    if mesh["tp"].size() > 1:
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    dp_mesh = mesh["dp_replicate", "dp_shard"]  # 2-D: HSDP (replicate x shard)
    for block in model.blocks:
        if any(True for _ in block.parameters()):  # not another stage's nn.Identity
            fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def pipeline(args: argparse.Namespace, model: GPTStage, mesh: DeviceMesh, device: Any) -> Any:
    """The schedule over this rank's stage, with the stage's input and output shapes given
    (no shape inference); the loss is the batch's mean cross-entropy per micro-batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage, pp, cfg = mesh.get_local_rank("pp"), args.pp, model.config
    mb, t, width = args.batch_size // args.microbatches, cfg.block_size, cfg.n_embd
    if stage == 0:
        inputs = torch.empty(mb, t, dtype=torch.long, device=device)
    else:
        inputs = torch.empty(mb, t, width, device=device, requires_grad=True)
    out = torch.empty(mb, t, cfg.vocab_size if stage == pp - 1 else width, device=device)
    out.requires_grad_(True)
    staged = PipelineStage(
        model, stage, pp, device, input_args=inputs, output_args=out, group=mesh.get_group("pp")
    )
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    return kind(staged, n_microbatches=args.microbatches, loss_fn=_loss)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], mesh_flags)
    rt = resilient.init(
        args.ckpt_dir,
        run_dir=args.run_dir,  # resilient
        save_every_steps=args.save_every,
        async_save=not args.sync_save,
    )
    device = device_for(rt.ctx.local_rank)
    mesh = build_mesh(args, rt.world_size)
    # the data-parallel degree and this rank's coordinate, row-major over (replicate, shard)
    shard = mesh["dp_shard"].size()
    dp = mesh["dp_replicate"].size() * shard
    dp_rank = mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard")

    torch.manual_seed(args.seed)  # same initial weights on every rank
    config = GPTConfig(
        vocab_size=CharTokenizer().vocab_size, fused_qkv=False, tied_head=False, n_layer=args.layers
    )
    stage = mesh.get_local_rank("pp") if args.pp > 1 else 0
    # a stage keeps the model's names and only its layers; --pp 1: the whole model
    model = GPTStage(config).keep(stage, args.pp).to(device)
    parallelize(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loader = build_loader(args, dp_rank, dp)  # split over data parallelism, not the world
    torch.manual_seed(args.seed + dp_rank)  # dropout: one stream per data-parallel coordinate

    rt.track(  # resilient: the mesh tells data parallelism from tensor parallelism
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        mesh=mesh,
        global_batch_size=args.global_batch,
    )
    batches = rt.batches()  # resilient: resumable, epoch-aware iterator over the loader
    samples = SampleLog(args.sample_log, rt.rank, rt.world_size, dp, dp_rank)
    schedule = pipeline(args, model, mesh, device) if args.pp > 1 else None
    last = stage == args.pp - 1
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):  # resilient: resumes, saves
        accum = rt.grad_accum  # resilient: micro-batches per step, kept across a resize
        ids: list[int] = []
        total = torch.zeros((), device=device)
        if schedule is not None and accum != 1:
            raise resilient.ConfigError(
                f"--pp runs one batch per step; this mesh needs {accum} per step to keep the "
                "global batch: keep the data-parallel degree when resizing a pipeline"
            )
        for _ in range(accum):
            idx, x, y = next(batches)
            ids += [int(i) for i in idx]
            if schedule is None:
                loss = _loss(model(x.to(device)), y.to(device))
                (loss / accum).backward()
                total += loss.detach() / accum
            elif stage == 0:
                schedule.step(x.to(device))
            elif last:
                losses: list[torch.Tensor] = []
                schedule.step(target=y.to(device), losses=losses)
                total = torch.stack(losses).mean().detach()
            else:
                schedule.step()
        # resilient: fingerprints and loss-spike checks; a pipeline's loss is on its last stage
        rt.observe(loss=total if last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        samples.write(step, ids, accum)
        if rt.rank == (rt.world_size - 1 if args.pp > 1 else 0) and step % args.log_every == 0:
            print(f"step {step} loss {total.item():.4f}", flush=True)

    samples.close()
    write_digest(rt, model, optimizer, mesh.get_group("pp") if args.pp > 1 else None)
    rt.close()  # resilient


if __name__ == "__main__":
    main()
