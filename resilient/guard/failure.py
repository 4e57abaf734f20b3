"""What kind of failure an exception is, as the guard judges it.

One judgment for both of the guard's paths: the store path (guard.py) and the in-place
agreement of micro-batches (attempt.py). A module of its own because both of those use it
and the agreement may not import the guard (which imports it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from resilient.groups._torch_compat import is_peer_loss_message

__all__ = ["classify", "short"]


def classify(exc: BaseException) -> str:
    """The kind of `exc`: "oom", "peer" (a collective failed because a peer is gone) or
    "exception"."""
    # torch re-raises some errors as its own, the original as the cause (a pipeline stage's
    # "Failed to run stage backward" over the gloo error of DDP's all-reduce in it)
    chain: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and at not in chain and len(chain) < 8:
        chain.append(at)
        at = at.__cause__
    if any(isinstance(e, torch.OutOfMemoryError) for e in chain):
        return "oom"
    # A failing collective after a peer died or hung: not this rank's fault. The monitor
    # names the culprit; this rank only waits for its verdict.
    if any(isinstance(e, dist.DistError) or is_peer_loss_message(str(e)) for e in chain):
        return "peer"
    return "exception"


def short(exc: BaseException) -> str:
    """`exc` in one line for logs and verdicts (its type and the first 500 characters)."""
    return f"{type(exc).__name__}: {str(exc).strip()[:500]}"
