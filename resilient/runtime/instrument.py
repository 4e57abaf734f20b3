"""Model and optimizer instrumentation: hooks that move a rank's `Progress` through the
phases of a step (forward, backward, optimizer) without a line in the user's loop."""

from __future__ import annotations

from typing import Any

from torch import nn

from resilient.runtime.phases import Phase, Progress

__all__ = ["instrument"]


def instrument(p: Progress, model: nn.Module | None, optimizer: Any) -> list[Any]:
    """Register the phase hooks on `model` and `optimizer`; returns their handles."""
    handles: list[Any] = []
    if model is not None:
        handles.append(model.register_forward_pre_hook(lambda *_: p.enter(Phase.FORWARD)))
        handles.append(model.register_forward_hook(lambda *_: p.enter(Phase.BACKWARD)))
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in model.modules() if m is not model and isinstance(m, FSDPModule)]
        for m in sharded:  # FSDP2 gathers per block: a hang between blocks shows as lag
            handles.append(m.register_forward_pre_hook(lambda *_: p.tick()))
        params = [q for q in model.parameters() if q.requires_grad]
        if params and not sharded:
            # the first gradient tells "backward started" apart from "still before it"
            handles.append(params[-1].register_post_accumulate_grad_hook(lambda _: p.tick()))
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(lambda *_: p.enter(Phase.OPTIMIZER)))
        handles.append(optimizer.register_step_post_hook(lambda *_: p.enter(Phase.STEP)))
    return handles
