"""A tiny training setup for checkpoint tests that run in one process."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from resilient.checkpoint import TrainState, state_digest

__all__ = ["Trainee"]


class Trainee:
    """A tiny model, AdamW and a StepLR, trained on data from its own generator."""

    def __init__(self, seed: int, *, widths: tuple[int, ...] = (13, 7, 5)) -> None:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.model = nn.Sequential(*layers[:-1])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.width = widths[0]

    def train(self, steps: int, *, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(4, self.width, generator=g)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()

    def state(self) -> TrainState:
        return TrainState(model=self.model, optimizer=self.opt, common={"scheduler": self.sched})

    def digest(self) -> str:
        return state_digest(self.model, self.opt)
