"""Train a small GPT on a device mesh: HSDP or FSDP2 over data parallelism, tensor parallel.

    torchrun --nproc-per-node 4 recipes/train_nd.py --dp-shard 2 --tp 2 --ckpt-dir /tmp/ckpt
    torchrun --nproc-per-node 4 recipes/train_nd.py --dp-replicate 2 --dp-shard 2 --tp 1 ...

The world mesh is ("dp_replicate", "dp_shard", "tp"); `--dp-shard -1` (the default) takes the
ranks the other two leave. Tensor parallel splits each block's attention by heads (q, k and v
column-wise, the output projection row-wise) and its MLP (fc column-wise, proj row-wise);
fully_shard then shards over the data-parallel dimensions (HSDP when dp-replicate > 1).
The loader is split over the data-parallel degree at the data-parallel coordinate, so tp
peers draw the same batch; dropout is seeded by that coordinate, so tp peers draw the same
masks on the activations they share. Each step runs `rt.grad_accum` micro-batches: a restart
on a smaller data-parallel degree keeps the global batch. Lines marked # resilient are all
the integration there is; docs/porting.md walks through it.
"""

import argparse

import torch
from common.cli import SampleLog, build_loader, device_for, parse_args, write_digest
from common.data import CharTokenizer
from common.model import GPT, GPTConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import resilient

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def mesh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (1: FSDP2)")
    p.add_argument("--dp-shard", type=int, default=-1, help="FSDP shards; -1: the rest")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step (default: --batch-size x the data-parallel degree); "
        "a multiple of it runs that many micro-batches per step",
    )


def build_mesh(args: argparse.Namespace, world_size: int) -> DeviceMesh:
    rep, tp = args.dp_replicate, args.tp
    shard = args.dp_shard if args.dp_shard > 0 else world_size // max(1, rep * tp)
    if rep * shard * tp != world_size:
        raise SystemExit(
            f"--dp-replicate {rep} x --dp-shard {args.dp_shard} x --tp {tp} does not make "
            f"{world_size} ranks: make their product the world size (or --dp-shard -1)"
        )
    cfg = GPTConfig()
    if cfg.n_head % tp or 4 * cfg.n_embd % tp:
        raise SystemExit(f"--tp {tp} must divide the model's {cfg.n_head} heads")
    device = "cuda" if torch.cuda.is_available() else "cpu"
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
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


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
    config = GPTConfig(vocab_size=CharTokenizer().vocab_size, fused_qkv=False)
    model = GPT(config).to(device)
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
    for step in rt.steps(total=args.steps, stop_at=args.stop_at):  # resilient: resumes, saves
        accum = rt.grad_accum  # resilient: micro-batches per step, kept across a resize
        ids: list[int] = []
        total = torch.zeros((), device=device)
        for _ in range(accum):
            idx, x, y = next(batches)
            _, loss = model(x.to(device), y.to(device))
            (loss / accum).backward()
            total += loss.detach() / accum
            ids += [int(i) for i in idx]
        rt.observe(loss=total)  # resilient: fingerprints and loss-spike checks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        samples.write(step, ids, accum)
        if rt.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {total.item():.4f}", flush=True)

    samples.close()
    write_digest(rt, model, optimizer)
    rt.close()  # resilient


if __name__ == "__main__":
    main()
