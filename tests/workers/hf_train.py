"""Worker of tests/test_weights.py: a tiny Hugging Face Llama, built from a config (no
download), trained under resilient with FSDP2.

    resilient run --nproc-per-node 2 hf_train.py --ckpt-dir D --run-dir R --out O --steps N
        [--init-from SRC] [--init-exclude GLOB]

Rank 0 writes O/first.pt (the full weights as the first step sees them, before its forward)
and, at the end, O/final.pt (the full weights), O/logits.pt (the logits of a plain model
holding them on O/input.pt's tokens) and O/config/config.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import resilient

VOCAB, SEQ, BATCH = 96, 16, 4


def config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=opts).items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--init-from", default=None)
    p.add_argument("--init-exclude", action="append", default=[])
    args = p.parse_args()
    init = {"init_from": args.init_from} if args.init_from else {}
    if args.init_exclude:
        init["init_exclude"] = tuple(args.init_exclude)
    rt = resilient.init(args.ckpt_dir, run_dir=args.run_dir, save_every_steps=2, **init)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt.track(model=model, optimizer=opt)
    args.out.mkdir(parents=True, exist_ok=True)
    first = True
    for step in rt.steps(total=args.steps):
        if first:
            weights = full_weights(model)  # a collective: every rank
            if rt.rank == 0:
                torch.save(weights, args.out / "first.pt")
            first = False
        g = torch.Generator().manual_seed(1000 * step + rt.rank)
        tokens = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    weights = full_weights(model)
    if rt.rank == 0:
        torch.save(weights, args.out / "final.pt")
        plain = LlamaForCausalLM(config())
        plain.load_state_dict(weights)
        plain.eval()
        tokens = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = plain(input_ids=tokens).logits
        torch.save({"tokens": tokens, "logits": logits}, args.out / "logits.pt")
        config().save_pretrained(args.out / "config")
    rt.close()


if __name__ == "__main__":
    main()
