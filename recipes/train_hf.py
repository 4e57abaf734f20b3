"""Train a tiny GPT-2 with the Hugging Face Trainer, exactly resumable by resilient.

    resilient run --nproc-per-node 2 recipes/train_hf.py --out /tmp/hf --steps 60

The model is built from a config (no download) and trains on a generated corpus through two
loader workers, with a random augmentation in `__getitem__` (one token swapped per sample),
as real Trainer scripts do. The line marked # resilient is the whole integration: without it
(`--plain`) this is a stock Trainer script, which resumes through the Trainer's own
`resume_from_checkpoint`. Rank 0 writes the final state's digest to <out>/digest.txt.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

VOCAB, SEQ = 64, 32


class Corpus(Dataset):
    """Fixed token sequences; each draw swaps one random position for a random token."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i].clone()
        at = int(torch.randint(0, SEQ, ()))  # the augmentation: the worker's RNG
        ids[at] = int(torch.randint(0, VOCAB, ()))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--width", type=int, default=32, help="the model's width (n_embd)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (the Trainer's fsdp settings)")
    p.add_argument("--plain", action="store_true", help="the stock Trainer, its own resume")
    args = p.parse_args()

    if args.plain:
        from transformers import Trainer
    else:
        from resilient.integrations.hf import Trainer  # resilient

    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=args.width, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=10,
        dataloader_num_workers=args.workers,
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        full_determinism=torch.cuda.is_available(),  # a bitwise resume on a GPU needs it
        ddp_backend="gloo" if not torch.cuda.is_available() else None,
        disable_tqdm=True,
        **(
            {
                "fsdp": "full_shard auto_wrap",
                "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
            }
            if args.fsdp
            else {}
        ),
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Corpus(args.samples))
    last = get_last_checkpoint(targs.output_dir) if os.path.isdir(targs.output_dir) else None
    trainer.train(resume_from_checkpoint=last)

    from resilient import state_digest

    digest = state_digest(trainer.model_wrapped, getattr(trainer.optimizer, "optimizer", None))
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "digest.txt").write_text(f"{trainer.state.global_step} {digest}\n")
        print(f"[train_hf] step {trainer.state.global_step} digest {digest}", file=sys.stderr)


if __name__ == "__main__":
    main()
