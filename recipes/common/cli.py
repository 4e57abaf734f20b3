"""The plumbing both recipes share: flags, the data loader, the device and the final digest.

Kept apart so each recipe file shows only the training loop and its resilient lines.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from .data import build_dataset

__all__ = ["build_loader", "device_for", "parse_args", "split_at", "write_digest"]


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="leave after this step with a checkpoint (the schedule still spans --steps)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=0, help="dataloader worker processes")
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("RESILIENT_CHECKPOINT_DIR", "checkpoints"),
        help="checkpoint directory or fsspec URL",
    )
    p.add_argument("--run-dir", default=None, help="event logs and the final digest go here")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps")
    p.add_argument("--sync-save", action="store_true", help="synchronous saves (default async)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--corpus-chars", type=int, default=300_000)
    p.add_argument(
        "--micro-batches",
        action="store_true",
        help="step through rt.micro_batches (DDP: an OOM retries the batch in smaller parts "
        "in place; with snapshots on, an exception rolls every rank back in place)",
    )
    p.add_argument(
        "--splits",
        default="",
        help="with --micro-batches: least micro-batches per step, 'STEP:SPLIT,...', each from "
        "its step on (the split an OOM retry leaves behind, for a reference run)",
    )
    return p.parse_args()


def split_at(splits: str, step: int) -> int | None:
    """The least split `--splits` asks for at `step` (None: no minimum)."""
    split = None
    for item in filter(None, splits.split(",")):
        first, k = (int(v) for v in item.split(":"))
        if first <= step:
            split = max(split or 1, k)
    return split


def build_loader(args: argparse.Namespace, rank: int, world_size: int) -> StatefulDataLoader:
    """A resumable loader over this rank's shard of the corpus, reshuffled each epoch."""
    dataset, _ = build_dataset(block_size=64, num_chars=args.corpus_chars, seed=args.seed)
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    return StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=True,
        # its own generator: iterator creation then draws nothing from
        # the global RNG that dropout uses (docs/internals.md#g-loader-rng)
        generator=torch.Generator().manual_seed(args.seed),
    )


def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def write_digest(rt: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the full model+optimizer state, written to <run_dir>/final_digest.json."""
    import resilient

    digest = resilient.state_digest(model, optimizer)
    if rt.rank == 0:
        path = os.path.join(rt.run_dir, "final_digest.json")
        with open(path, "w") as f:
            json.dump({"step": rt.step, "world_size": rt.world_size, "digest": digest}, f)
        print(f"final step {rt.step} state sha256 {digest} -> {path}", flush=True)
    return digest
