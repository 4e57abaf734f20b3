"""Model and optimizer instrumentation: hooks that move a rank's `Progress` through the
phases of a step (forward, backward, optimizer) without a line in the user's loop."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resilient.hang.phases import Phase, Progress

__all__ = ["instrument"]


def instrument(
    p: Progress, model: nn.Module | None, optimizer: Any, stage: int | None = None
) -> list[Any]:
    """Register the phase hooks on `model` and `optimizer`; returns their handles. A
    pipeline `stage` (its index) also counts its micro-batches (`_micro_batches`)."""
    handles: list[Any] = []
    if model is not None and stage is not None:
        p.stage = stage
        handles += _micro_batches(p, model)
    if model is not None:
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in model.modules() if m is not model and isinstance(m, FSDPModule)]

        def before_forward(*_: Any) -> None:
            if p.phase is Phase.EVAL:  # an evaluation's forwards: it keeps its own phase
                p.tick()
            else:
                p.enter(Phase.FORWARD)

        handles.append(model.register_forward_pre_hook(before_forward))

        def after_forward(_m: nn.Module, _args: Any, output: Any) -> None:
            if p.phase is Phase.EVAL:
                return
            p.enter(Phase.BACKWARD)
            if sharded:  # the gradient reaching the output: past it before any gather
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda _g: p.tick())

        # ahead of FSDP2's post-forward (prepend), so the tick's tensor hooks come before
        # the ones FSDP2 puts on the same outputs to gather the parameters for backward
        handles.append(model.register_forward_hook(after_forward, prepend=True))
        # FSDP2 gathers per block: a hang between blocks shows as lag. Ahead of FSDP2's own
        # hook (prepend), so a rank blocked in a block's all-gather has already ticked past
        # the peer that never arrives, which stays furthest behind and is named alone
        for m in sharded:
            handles.append(m.register_forward_pre_hook(lambda *_: p.tick(), prepend=True))
        params = [q for q in model.parameters() if q.requires_grad]
        if params and not sharded:
            # the first gradient tells "backward started" apart from "still before it"
            handles.append(params[-1].register_post_accumulate_grad_hook(lambda _: p.tick()))
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(lambda *_: p.enter(Phase.OPTIMIZER)))
        handles.append(optimizer.register_step_post_hook(lambda *_: p.enter(Phase.STEP)))
    return handles


def _micro_batches(p: Progress, model: nn.Module) -> list[Any]:
    """A pipeline stage's module runs once per micro-batch, in order: its k-th forward of a
    step is micro-batch k's, and the gradient reaching that forward's output starts
    micro-batch k's backward. Registered ahead of the phase hooks (prepend), so the phase
    entered by those carries the micro-batch already."""
    seen = {"step": -2, "n": 0}

    def before(*_: Any) -> None:
        if seen["step"] != p.step:
            seen["step"], seen["n"] = p.step, 0
        p.micro_batch(seen["n"], backward=False)
        seen["n"] += 1

    def after(_m: nn.Module, _args: Any, output: Any) -> None:
        k = p.micro
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(lambda _g, k=k: p.micro_batch(k, backward=True))
                break

    return [
        model.register_forward_pre_hook(before, prepend=True),
        model.register_forward_hook(after),
    ]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []
