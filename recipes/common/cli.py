"""The plumbing both recipes share: flags, the data loader, the device and the final digest.

Kept apart so each recipe file shows only the training loop and its resilient lines.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from .data import build_dataset

__all__ = [
    "SampleLog",
    "build_loader",
    "device_for",
    "parse_args",
    "split_at",
    "write_digest",
]


def parse_args(
    description: str, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The recipes' common flags; `more` adds a recipe's own (recipes/train_nd.py's mesh)."""
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
    p.add_argument(
        "--sample-log",
        default=None,
        help="append the sample ids each step trained on to DIR/rank<R>.jsonl, one line per "
        "rank and step (an audit of the data position; the chaos harness checks it)",
    )
    if more is not None:
        more(p)
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
    """A resumable loader over this rank's shard of the corpus, reshuffled each epoch.
    `rank` and `world_size` are the data-parallel coordinate and degree: on a mesh with
    tensor parallelism, not the global rank and world (recipes/train_nd.py)."""
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
    """cuda:<local rank> where a GPU exists, with deterministic kernels: a bitwise resume needs
    the same bits from the same inputs, which some CUDA kernels (atomics) and cuBLAS's
    workspace choice do not give by default. CPU kernels are deterministic already."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first use
    torch.use_deterministic_algorithms(True)
    return torch.device("cuda", local_rank)


def write_digest(
    rt: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any = None
) -> str:
    """sha256 of the full model+optimizer state, written to <run_dir>/final_digest.json; with
    a pipeline's `group`, of every stage's digest in stage order."""
    import resilient

    digest = resilient.state_digest(model, optimizer)
    if group is not None:  # pipeline stages: each holds its own layers; one digest of all
        import hashlib

        import torch.distributed as dist

        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, digest, group=group)
        digest = hashlib.sha256("".join(every).encode()).hexdigest()
    if rt.rank == 0:
        path = os.path.join(rt.run_dir, "final_digest.json")
        with open(path, "w") as f:
            json.dump({"step": rt.step, "world_size": rt.world_size, "digest": digest}, f)
        print(f"final step {rt.step} state sha256 {digest} -> {path}", flush=True)
    return digest


class SampleLog:
    """`--sample-log DIR`: one JSON line per step on each rank, the sample ids it trained on
    with the world, the data-parallel degree and coordinate and the micro-batches per step.
    Appended, so a resumed attempt's lines follow the earlier ones (the later record of a
    step wins)."""

    def __init__(self, directory: str | None, rank: int, world: int, dp: int, dp_rank: int):
        self._f = None
        self._base = {"rank": rank, "world": world, "dp": dp, "dp_rank": dp_rank}
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._f = open(os.path.join(directory, f"rank{rank}.jsonl"), "a")  # noqa: SIM115

    def write(self, step: int, ids: list[int], accum: int) -> None:
        if self._f is not None:
            line = {**self._base, "step": step, "accum": accum, "ids": ids, "t": time.time()}
            self._f.write(json.dumps(line) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
