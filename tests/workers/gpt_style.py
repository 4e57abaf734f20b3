"""A nanoGPT-shaped step loop on DDP: batches sampled with the global RNG, dropout, gradient
accumulation over micro-steps.

    torchrun --nproc-per-node 2 tests/workers/gpt_style.py --steps 12 --accum 2

--sync: how the micro-steps skip the all-reduce: `require` sets
model.require_backward_grad_sync (nanoGPT), `no_sync` uses `with model.no_sync()`.
--prefetch: nanoGPT's own order, the next batch fetched at the end of each micro-step and
carried into the next step in a local variable: after a resume the run trains on other data
(the replay check and `resilient check-resume` must say so). Without it the fetch is at the
start of each micro-step: the one-line change that makes the loop exact.
--unseeded: the model is built without a seed (torch's default seed differs per process), so
two runs differ from step 0, before any resume (check-resume must say so, not blame the resume).
--no-zero-grad: the loop never calls zero_grad(), so gradients carry from step to step and no
checkpoint holds them (grads.carried at the first save; check-resume names it). Checkpoint and log
locations come from $RESILIENT_CHECKPOINT_DIR and $RESILIENT_RUN_DIR.
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--sync", choices=["require", "no_sync"], default="require")
p.add_argument("--prefetch", action="store_true")
p.add_argument("--save-every", type=int, default=3)
p.add_argument("--unseeded", action="store_true")
p.add_argument("--no-zero-grad", action="store_true")
args = p.parse_args()

rt = resilient.init(save_every_steps=args.save_every, async_save=False)
if args.unseeded:  # a fresh interpreter's default seed, which differs per process (the
    torch.seed()  # tests' fork server would otherwise hand every fork the same RNG state)
else:
    torch.manual_seed(1337)  # same initial weights everywhere (and in every run)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randn(256, 16, generator=torch.Generator().manual_seed(rt.rank))
target = data.sum(dim=1, keepdim=True).sin()
torch.manual_seed(1337 + rt.rank)  # each rank samples its own batches


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data), (8,))
    return data[ix], target[ix]


rt.track(model=model, optimizer=optimizer)
if args.prefetch:
    X, Y = get_batch()  # fetch the very first batch
for _step in rt.steps(args.steps):
    for micro_step in range(args.accum):
        last = micro_step == args.accum - 1
        if not args.prefetch:
            X, Y = get_batch()
        if args.sync == "require":
            model.require_backward_grad_sync = last
        skip = model.no_sync() if args.sync == "no_sync" and not last else contextlib.nullcontext()
        with skip:
            loss = F.mse_loss(model(X), Y) / args.accum
            if args.prefetch:
                X, Y = get_batch()  # immediately async prefetch next batch
            loss.backward()
        rt.observe(loss=loss)
    optimizer.step()
    if not args.no_zero_grad:
        optimizer.zero_grad(set_to_none=True)
rt.close()
