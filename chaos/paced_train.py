"""A DDP loop of a chosen pace: the workload of hang detection's benchmark and of the
false-alarm scenarios (scripts/bench_detect.py, chaos/quiet.py).

    resilient run --nproc-per-node 2 -m chaos.inject --fault hang@rank=1,step=40 -- \
        chaos/paced_train.py --step-s 0.1 --steps 80 --ckpt-dir C --run-dir R

Each step's forward takes about `--step-s` (a sleep inside the model: the forward phase holds
the step's time, as a real model's compute would), then DDP's gradient all-reduce. Rank 0
evaluates alone every `--eval-every` steps inside `rt.phase("eval")`, two forwards through the
tracked DDP model (whose hooks enter phase forward; the others wait for it in the next step's
all-reduce). Checkpoints every `--save-every` steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import resilient


class _Paced(torch.nn.Module):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.step_s)
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=0, help="0: no evaluation")
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    rt = resilient.init(
        args.ckpt_dir, run_dir=args.run_dir, save_every_steps=args.save_every, async_save=False
    )
    torch.manual_seed(0)
    model = _Paced(args.step_s)
    ddp = DDP(model) if rt.world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # state: hot snapshots copy it
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    sampler = StatefulDistributedSampler(data, num_replicas=rt.world_size, rank=rt.rank, seed=0)
    loader = StatefulDataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
    rt.track(model=ddp, optimizer=optimizer, loader=loader)
    batches = rt.batches()
    for step in rt.steps(total=args.steps):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.eval_every and step % args.eval_every == 0 and rt.rank == 0:
            with rt.phase("eval"), torch.no_grad():
                for _ in range(2):  # through the tracked model: its hooks enter forward
                    ddp(x)  # no buffers, no grad: no DDP collective on one rank
    rt.close()


if __name__ == "__main__":
    main()
