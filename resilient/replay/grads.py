"""Gradients carried across a step boundary: state that no checkpoint holds.

A checkpoint is taken between two steps and holds the parameters, the optimizer and the
RNGs, never `.grad`. A loop that zeroes its gradients after `optimizer.step()` (or at the
start of the next step) loses nothing; a loop that never calls `zero_grad()` adds each step's
gradients to the last one's, and a resumed run starts that sum from zero: it trains on other
gradients from its first step on.

At the first save after a backward (the first that finds a `.grad` at all) the parameters'
`.grad` are looked at. If one holds non-zero values at that step boundary, a one-shot hook on
it looks again when the next backward reaches it, before the new gradient is added: still
non-zero there means the loop carried it into the step (a loop that zeroes at the start of a
step has zeroed it by then), and `grads.carried` is logged once, as a warning. `resilient
check-resume` names it as the likely cause of a divergence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resilient.events import GRADS_CARRIED

__all__ = ["ADVICE", "CarriedGrads"]

ADVICE = (
    "gradients carried across steps are not in any checkpoint: a resumed run starts them from "
    "zero and trains on other gradients. Call optimizer.zero_grad() once per step (after "
    "optimizer.step(), or before the step's first backward)"
)


def _nonzero(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    local = grad.to_local() if hasattr(grad, "to_local") else grad  # DTensor: this rank's
    return bool(local.numel()) and bool(local.detach().ne(0).any())


class CarriedGrads:
    """Looks once, at the first save (`at_save`); at most one warning per process."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._looked = False
        self._hook: Any = None

    def at_save(self, model: nn.Module | None, step: int) -> None:
        if self._looked or model is None:
            return
        grads = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        if not grads:  # none yet (a save before any step), or set to None: the next save
            return
        self._looked = True
        held = [(n, p) for n, p in grads if _nonzero(p.grad)]
        if not held:
            return
        name, param = held[0]
        if not param.requires_grad:
            return

        def look(grad: torch.Tensor) -> None:  # before the new gradient is added to .grad
            self.remove()
            if _nonzero(param.grad):
                self._log.warning(
                    GRADS_CARRIED, step=step, param=name, held=len(held), advice=ADVICE
                )

        self._hook = param.register_hook(look)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
