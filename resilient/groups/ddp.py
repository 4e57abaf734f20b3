"""DDP's gradient-bucket layout, fixed so that fresh and resumed processes reduce alike.

Why this exists: DDP (torch 2.13, find_unused_parameters=False or static_graph=True) reduces
its first iteration in one bucket holding every gradient, then rebuilds the buckets in the
order gradients became ready and keeps that layout. A process resumed from a checkpoint is a
new process, so its first step again uses the one-bucket layout where the uninterrupted run
had long been using the rebuilt one. On 3 or more ranks gloo's ring all-reduce sums each
element in an order set by the element's offset in its bucket (which chunk of the ring it
falls in), so a different layout gives different float sums: the resumed run drifts from the
uninterrupted one from that step on (measured: 3 ranks, step 8 of 16, equal inputs, loss and
parameters, different reduced gradients). Two ranks hide it, since a + b == b + a.

The fix: before the first iteration of every process, rebuild the buckets from all parameters
in DDP's parameter order (the reducer's own `_push_all_rebuilt_params`, which DDP's join hook
uses for ranks that ran out of data, then `_rebuild_buckets`), with DDP's own size caps. The
layout then never changes and is the same in every process, fresh or resumed, and DDP's
forward no longer holds the rebuild's broadcast in the second step (which the OOM guard's
retry relies on: guard/attempt.py). The cost: buckets follow parameter order instead of
gradient-ready order, so less communication overlaps the backward pass. That is negligible for
the small models of recipes/ (two buckets) and not measured here for large GPU models, which
is why `RuntimeConfig.pin_ddp_buckets` can turn it off.

torch has no public way to choose or persist a bucket layout (the bucket sizes are
construction options, the order is not), so this needs the reducer's private methods; they
are reached only through groups/_torch_compat.py, which checks them at import.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from resilient.groups import _torch_compat as tc

__all__ = ["ddp_modules", "forward_unsynced", "pin_buckets", "reset_reducer"]

# The DDP modules whose layout we fixed; reset_reducer() fixes them again after a reset.
_PINNED: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def ddp_modules(model: nn.Module) -> list[DistributedDataParallel]:
    """The DDP instances in `model` (itself included), outermost first."""
    return [m for m in model.modules() if isinstance(m, DistributedDataParallel)]


def _supported(ddp: DistributedDataParallel) -> str | None:
    """Why the layout of `ddp` cannot be fixed here, or None when it can."""
    if tc.uses_python_reducer(ddp):
        return "python_reducer"  # compiled-autograd DDP buckets in its own way
    if tc.delays_all_reduce(ddp):
        return "all_params_delayed"  # no reducer buckets in use
    if not hasattr(ddp, "reducer"):  # DDP builds none in some configurations
        return "no_reducer"
    return None


def pin_buckets(ddp: DistributedDataParallel) -> str:
    """Fix `ddp`'s gradient buckets now, in parameter order, for the rest of the process.

    A collective on `ddp.process_group` (rank 0's layout is broadcast): every rank calls it
    at the same point, before its first training forward. Returns what happened: "pinned";
    "never_rebuilt" when DDP keeps its first layout for good anyway
    (find_unused_parameters=True without static_graph), which resumes exactly as it is;
    "already_rebuilt" when this process had trained through `ddp` before (DDP then keeps
    the layout of that warm-up, which a resumed process repeating it gets too); or why it is
    not supported.
    """
    why = _supported(ddp)
    if why is not None:
        return why
    if tc.has_rebuilt_buckets(ddp):
        return "already_rebuilt"
    # No-op where DDP never rebuilds, or where a backward already recorded its ready order.
    tc.push_all_rebuilt_params(ddp)
    if not tc.rebuild_buckets(ddp):
        return "never_rebuilt"
    tc.set_rebuilt_buckets(ddp, True)  # what DDP's own forward records after a rebuild
    _PINNED.add(ddp)
    return "pinned"


def reset_reducer(ddp: DistributedDataParallel) -> None:
    """Disarm `ddp`'s reducer after a backward that never came (see guard/attempt.py).

    DDP's `_reset_state` (as in its own `_update_process_group`) also makes DDP rebuild its
    buckets in gradient-ready order: a collective inside a later forward, where a rank that
    fails before its forward would leave its peers waiting. For a pinned module the
    parameter-order layout is rebuilt here instead, so forwards stay free of collectives and
    the layout stays the one every process uses; that is a collective on
    `ddp.process_group`, so every rank calls this at the same point, as the guard does.
    """
    tc.reset_reducer_state(ddp)
    tc.set_rebuilt_buckets(ddp, False)
    if ddp in _PINNED:
        tc.push_all_rebuilt_params(ddp)
        if tc.rebuild_buckets(ddp):
            tc.set_rebuilt_buckets(ddp, True)


def forward_unsynced(ddp: DistributedDataParallel) -> list[Any]:
    """Run every forward of `ddp` under its `no_sync()`: for a pipeline stage (see below).

    torch's pipeline schedules (torch.distributed.pipelining, checked with torch 2.13) run
    each micro-batch's forward under `no_sync()` and arm DDP's reduction themselves before the
    step's last backward. The one forward they do not guard is the shape inference of the
    first `schedule.step()` in each process: a forward with gradient sync on, after which DDP
    arms its reducer for a backward. The inference's own backward computes input gradients
    only, so the first micro-batch's real backward is the one that gets reduced: its
    gradients are averaged over the data-parallel ranks on their own, then summed with the
    other micro-batches' and averaged again. Mathematically the same, but not the same
    floats as every later step, so a resumed process (whose first step is a later step of the
    run) drifted from the uninterrupted run in the 7th digit.

    Every forward under `no_sync()` is what the schedules mean: the reduction they arm before
    the last backward does not depend on the forward. The hooks are removed by the caller
    (their handles are returned).
    """
    held: list[Any] = []

    def enter(module: DistributedDataParallel, _args: Any) -> None:
        cm = module.no_sync()
        cm.__enter__()
        held.append(cm)

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        if held:
            held.pop().__exit__(None, None, None)

    return [
        ddp.register_forward_pre_hook(enter),
        ddp.register_forward_hook(leave, always_call=True),
    ]
