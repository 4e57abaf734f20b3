"""Every torch internal the runtime uses, checked at import: DDP's reducer and error texts.

- DDP's reducer (`_push_all_rebuilt_params`, `_rebuild_buckets`, `_reset_state`) and the DDP
  attributes that say what it does (`_has_rebuilt_buckets`, `_use_python_reducer`,
  `_delay_all_reduce_all_params`): torch has no public way to choose or keep a bucket layout,
  which exact resume needs (docs/internals.md#g-ddp-bucket-layout). Used by groups/ddp.py.
- The reducer's `_get_zeros_like_grad_buckets` and `_run_comm_hook` (what DDP's join hook,
  `_match_all_reduce_for_bwd_pass`, runs for a rank that ran out of data): one all-reduce
  per gradient bucket, in the reducer's order, through the registered comm hook. The OOM
  guard lets a failed rank join its peers' gradient all-reduce with them, its buckets filled
  with NaN, so that the healthy ranks learn of the failure from their own reduced gradients
  (guard/attempt.py). DDP's `_comm_hooks` says whether a Python comm hook, which might not
  carry a NaN through, is registered.
- The text of the errors a collective raises when a peer is gone
  (docs/internals.md#g-dead-and-hung-peers): gloo raises a plain RuntimeError, not a
  DistError, for a closed connection, and only `monitored_barrier`'s message names a missing
  rank. Text cannot be checked at import; tests/test_guard.py and tests/test_hang.py produce
  these errors for real. A changed text is not silent either: the failure is then reported
  as the rank's own exception (ExitCode.RANK_EXCEPTION) instead of PEER_LOST.

- The text of torch < 2.13's refusal of a pipeline micro-batch whose shape differs from the
  first's (`micro_batch_sizes`): there it comes before the stage's own check of uneven
  micro-batches (runtime/stages.py), and is read as the same configuration error.

- `TORCH_GLOO_LAZY_INIT`, the environment variable torch's gloo backend reads when a group
  is created: set, the group connects each pair of ranks at its first collective between
  them instead of every pair at creation. Our side groups are made with it
  (`lazy_gloo_connections`): a full mesh through the store is N(N-1) lookups, 45 minutes at
  16,384 ranks (docs/hot-recovery.md). It is a variable, not a name, so it cannot be checked
  at import: a torch that ignores it makes eager groups, which work, only slower to set up.
  tests/test_torch_compat.py checks that this torch honours it.

A torch without one of the names fails here, at import, with TorchCompatError naming the
torch version and the feature (resilient/_torch_check.py).

Checked on torch 2.11.0, 2.12.0, 2.13.0, 2.14.1, 2.15.0 (the tested range): every name above
is there on each; the lazy connections (tests/test_torch_compat.py) and a peer's death read
as PEER_LOST (tests/test_hang.py) were run on the releases docs/operating.md#torch-releases
lists.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resilient._torch_check import require_attrs, require_self_attrs

__all__ = [
    "PEER_LOSS_MARKERS",
    "barrier_missing_ranks",
    "delays_all_reduce",
    "has_python_comm_hook",
    "has_rebuilt_buckets",
    "is_peer_loss_message",
    "lazy_gloo_connections",
    "match_backward_all_reduce",
    "micro_batch_sizes",
    "push_all_rebuilt_params",
    "rebuild_buckets",
    "reset_reducer_state",
    "set_rebuilt_buckets",
    "uses_python_reducer",
]

_FEATURE = "pinning DDP's gradient buckets for exact resume (groups/ddp.py)"
require_attrs(
    dist.Reducer,
    ("_push_all_rebuilt_params", "_rebuild_buckets", "_reset_state"),
    feature=_FEATURE,
)
_JOIN = "the OOM guard's agreement folded into the gradient all-reduce (guard/attempt.py)"
require_attrs(dist.Reducer, ("_get_zeros_like_grad_buckets", "_run_comm_hook"), feature=_JOIN)
require_self_attrs(DistributedDataParallel, ("_comm_hooks",), feature=_JOIN)
require_self_attrs(
    DistributedDataParallel,
    ("_has_rebuilt_buckets", "_use_python_reducer", "_delay_all_reduce_all_params", "reducer"),
    feature=_FEATURE,
)


# ---------------------------------------------------------------- DDP reducer
def uses_python_reducer(ddp: DistributedDataParallel) -> bool:
    """Compiled-autograd DDP, which buckets in its own way."""
    return bool(ddp._use_python_reducer)


def delays_all_reduce(ddp: DistributedDataParallel) -> bool:
    """Every parameter's all-reduce is delayed to the end: DDP built no reducer."""
    return bool(ddp._delay_all_reduce_all_params)


def has_rebuilt_buckets(ddp: DistributedDataParallel) -> bool:
    return bool(ddp._has_rebuilt_buckets)


def set_rebuilt_buckets(ddp: DistributedDataParallel, value: bool) -> None:
    """What DDP's own forward records after a rebuild (and `_reset_state`'s callers clear)."""
    ddp._has_rebuilt_buckets = value


def push_all_rebuilt_params(ddp: DistributedDataParallel) -> None:
    """Record every parameter, in DDP's order, as the next rebuild's order (DDP's join hook
    does this for ranks that ran out of data)."""
    ddp.reducer._push_all_rebuilt_params()


def rebuild_buckets(ddp: DistributedDataParallel) -> bool:
    """Rebuild the buckets from the recorded order; False where DDP never rebuilds. A
    collective on `ddp.process_group`."""
    return bool(ddp.reducer._rebuild_buckets())


def reset_reducer_state(ddp: DistributedDataParallel) -> None:
    """Disarm the reducer after a backward that never came (as DDP's own
    `_update_process_group` does)."""
    ddp.reducer._reset_state()


def match_backward_all_reduce(ddp: DistributedDataParallel, fill: float) -> None:
    """Join the peers' gradient all-reduce of a synced backward with every gradient equal to
    `fill`, without a backward of our own (one all-reduce per bucket, in the reducer's order,
    through the registered comm hook; waits for all of them). DDP's join hook does the same
    with zeros."""
    works = []
    for bucket in ddp.reducer._get_zeros_like_grad_buckets():
        bucket.buffer().fill_(fill)  # the bucket's own storage, not a copy
        works.append(ddp.reducer._run_comm_hook(bucket))
    for work in works:
        work.wait()


def has_python_comm_hook(ddp: DistributedDataParallel) -> bool:
    """A comm hook registered with `register_comm_hook` (DDP's built-in C++ hooks, which
    all-reduce or cast the bucket, are not listed)."""
    return bool(ddp._comm_hooks)


# ---------------------------------------------------------------- error texts
PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "gloo/transport",
    "failed to recv",
)
"""Fragments of the errors a collective raises after a peer died or hung (gloo; the same on
every tested torch release)."""

_BARRIER_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def is_peer_loss_message(text: str) -> bool:
    """The error text says a peer is gone (not this rank's own fault)."""
    return any(m in text for m in PEER_LOSS_MARKERS)


_STAGE_INPUT_SHAPES = re.compile(
    r"forward inputs: .*shape mismatch: expected torch\.Size\(\[(\d+)[^\]]*\]\) "
    r"actual torch\.Size\(\[(\d+)"
)


def micro_batch_sizes(exc: BaseException) -> tuple[int, int] | None:
    """(the first micro-batch's size, another's) when `exc` is torch's refusal of a pipeline
    stage's micro-batch whose first dimension differs from the first micro-batch's. torch <
    2.13 checks a stage's inputs against the first micro-batch's shapes before the module
    runs, so this, not the stage's own check (runtime/stages.py), meets uneven micro-batches
    there: "Stage 0 forward inputs: value 0 has a shape mismatch: expected torch.Size([3, 16])
    actual torch.Size([2, 16])" (a PipeliningShapeError)."""
    match = _STAGE_INPUT_SHAPES.search(str(exc))
    if type(exc).__name__ != "PipeliningShapeError" or match is None:
        return None
    first, other = int(match.group(1)), int(match.group(2))
    return None if first == other else (first, other)


def barrier_missing_ranks(text: str) -> list[int] | None:
    """The ranks a failed `monitored_barrier` names (rank 0 only gets them), or None."""
    match = _BARRIER_RANKS.search(text)
    if match is None:
        return None
    return [int(r) for r in match.group(1).replace(" ", "").split(",") if r]


GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def lazy_gloo_connections() -> Iterator[None]:
    """gloo groups created inside connect a pair of ranks at its first collective between
    them: a ring all-reduce or all-gather then connects each rank to its two neighbours, a
    barrier to log2(N) more, not to all N-1 (measured at 8 and 16 ranks,
    docs/hot-recovery.md). Only for groups made in the block: the variable is put back."""
    old = os.environ.get(GLOO_LAZY_INIT)
    os.environ[GLOO_LAZY_INIT] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GLOO_LAZY_INIT, None)
        else:
            os.environ[GLOO_LAZY_INIT] = old
