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

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from resilient.groups import _torch_compat as tc

__all__ = ["ddp_modules", "pin_buckets", "reset_reducer"]

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
