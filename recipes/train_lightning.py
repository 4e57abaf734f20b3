"""Train a tiny GPT-2 with Lightning, exactly resumable by resilient.

    resilient run --nproc-per-node 2 recipes/train_lightning.py --out /tmp/pl --steps 60

The model is built from a config (no download) and trains on a generated corpus through two
loader workers, with a random augmentation in `__getitem__` (one token swapped per sample),
with Lightning's ModelCheckpoint, a CSV logger and a validation pass each epoch. The two lines
marked # resilient are the whole integration: without them (`--plain`) this is a stock
Lightning script, which resumes through `fit(ckpt_path="last")`. Rank 0 writes the final
state's digest to <out>/digest.txt and Lightning's counters to <out>/lightning.txt.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 64, 32


class Corpus(Dataset):
    """Fixed token sequences; each draw swaps one random position for a random token."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = self.rows[i].clone()
        at = int(torch.randint(0, SEQ, ()))  # the augmentation: the worker's RNG
        ids[at] = int(torch.randint(0, VOCAB, ()))
        return ids


class TinyGPT(L.LightningModule):
    def __init__(
        self, samples: int, workers: int, total: int, fsdp: bool = False, width: int = 32
    ) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=2, n_head=2)
        self.model = GPT2LMHeadModel(config)
        self.samples, self.workers, self.total, self.fsdp = samples, workers, total, fsdp

    def configure_model(self) -> None:
        if self.fsdp and self.device_mesh is not None:  # ModelParallelStrategy: FSDP2
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, ids: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=self.total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            Corpus(self.samples), batch_size=4, shuffle=True, num_workers=self.workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Corpus(16, seed=99), batch_size=4)


def _strategy(fsdp: bool) -> object:
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return "auto"
    if not fsdp:
        return "ddp"
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = int(os.environ["WORLD_SIZE"])
    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--width", type=int, default=32, help="the model's width (n_embd)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2: Lightning's ModelParallelStrategy")
    p.add_argument("--plain", action="store_true", help="stock Lightning, its own resume")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)  # the same initial weights on every rank
    ckpt_dir = args.out / "lightning-ckpt"
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.save_steps, save_last=True)
    ]
    if not args.plain:
        from resilient.integrations.lightning import Resilient  # resilient

        callbacks.append(Resilient())  # resilient
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        deterministic=args.device == "cuda",  # a bitwise resume on a GPU needs them
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=_strategy(args.fsdp),
        max_steps=args.steps,
        accumulate_grad_batches=args.grad_accum,
        callbacks=callbacks,
        logger=CSVLogger(args.out, name="logs"),
        log_every_n_steps=10,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    model = TinyGPT(args.samples, args.workers, args.steps, fsdp=args.fsdp, width=args.width)
    last = ckpt_dir / "last.ckpt"
    resume = str(last) if args.plain and last.exists() else None
    trainer.fit(model, ckpt_path=resume)

    from resilient import state_digest

    digest = state_digest(model, trainer.optimizers[0])
    if trainer.global_rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "digest.txt").write_text(f"{trainer.global_step} {digest}\n")
        loop = trainer.fit_loop.epoch_loop
        (args.out / "lightning.txt").write_text(
            f"global_step={trainer.global_step} epoch={trainer.current_epoch} "
            f"batches_that_stepped={loop._batches_that_stepped}\n"
        )
        print(f"[train_lightning] step {trainer.global_step} digest {digest}", file=sys.stderr)


if __name__ == "__main__":
    main()
