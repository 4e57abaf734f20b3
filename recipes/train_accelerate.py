"""An Accelerate training loop (`Accelerator`, `prepare`, `accumulate`, `backward`), exactly
resumable by resilient: a tiny GPT-2 built from a config on a generated corpus, two loader
workers and a random augmentation in `__getitem__`.

    resilient run --nproc-per-node 2 recipes/train_accelerate.py --out /tmp/acc --steps 40

Launched by `resilient run` (or torchrun) in place of `accelerate launch`. The lines marked
# resilient are the port (docs/integrations.md#accelerate): the loader is not passed through
`accelerator.prepare` but tracked by the runtime, one step of `rt.steps()` is one optimizer
step of `--grad-accum` micro-batches, and the runtime's checkpoints replace `save_state`.
Rank 0 writes the final state's digest to <out>/digest.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

import resilient
from resilient.data.seeded import SeededSamples

VOCAB, SEQ = 64, 32


class Corpus(Dataset):
    """Fixed token sequences; each draw swaps one random position for a random token."""

    def __init__(self, n: int) -> None:
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i].clone()
        ids[int(torch.randint(0, SEQ, ()))] = int(torch.randint(0, VOCAB, ()))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--save-every", type=int, default=10)
    args = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=True)
    rt = resilient.init(save_every_steps=args.save_every)  # resilient
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    data = SeededSamples(Corpus(256), seed=0)  # resilient: workers' augmentations resume too
    sampler = StatefulDistributedSampler(data, rt.world_size, rt.rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    rt.track(  # resilient: the torch objects inside Accelerate's wrappers
        model=model, optimizer=optimizer.optimizer, scheduler=scheduler.scheduler, loader=loader
    )
    batches = rt.batches()  # resilient
    for _ in rt.steps(total=args.steps):  # resilient: one step = one optimizer step
        for _ in range(args.grad_accum):
            batch = {k: v.to(accelerator.device) for k, v in next(batches).items()}
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                rt.observe(loss=loss)  # resilient
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    digest = resilient.state_digest(model, optimizer.optimizer)
    if rt.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "digest.txt").write_text(f"{rt.step} {digest}\n")
        print(f"[train_accelerate] step {rt.step} digest {digest}", file=sys.stderr)
    rt.close()  # resilient


if __name__ == "__main__":
    main()
