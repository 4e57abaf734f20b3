"""The check that keeps a non-finite value (NaN, +inf, -inf) out of every committed checkpoint.

One NaN on one rank spreads through the gradient all-reduce, and from then on every step
trains on NaN. A save of that state, committed, would rotate the last good checkpoints out
of `keep_last`. So a save first looks at every floating-point tensor under its "model" and
"optim" entries (a DTensor: this rank's local shard), and the ranks agree on what they found
before any of them writes (`check_agreed`, from CheckpointManager._write_and_commit).

The screen is one `sum()` per tensor, stacked, and one `isfinite` over the stack: a NaN or an
infinity anywhere makes the sum non-finite (NaN + x is NaN, inf + -inf is NaN). It reads each
byte once and allocates nothing per element. Measured with scripts/bench_finite_check.py
(docs/benchmarks.md: 865 MiB of fp32 in transformer shapes, one thread, the 2-core test VM,
every way timed in the same rounds, three runs): the check itself (these sums) 0.031-0.032 s
per GiB; the sums alone 0.031-0.061, `torch._foreach_norm` (private) 0.036-0.041,
`torch.dot(t, t)` 0.038-0.074, `torch.aminmax` 0.045-0.057, `(t * 0).sum()` 0.058-0.29, and
`torch.isfinite(t).all()` 0.58-0.81 (it writes a bool tensor as large as
the input). A sum can also overflow to inf from finite values (fp32 values near 1e38): a
tensor the screen flags is counted exactly with `isnan`/`isinf`, and one with none is not an
offender. Half-precision tensors are summed into float32, where their sums cannot overflow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from resilient.checkpoint.collectives import Collectives
from resilient.checkpoint.duplicates import divergent, fingerprints, refusal
from resilient.errors import DivergentStateError, NumericalFaultError

__all__ = ["CHECKED", "NonFinite", "check_agreed", "find_nonfinite"]

CHECKED = ("model", "optim")
"""The state dict's entries whose tensors are checked: the model and optimizer state."""

_SUM_AS = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


@dataclass(frozen=True, slots=True)
class NonFinite:
    """One tensor with non-finite values: its key in the state dict and what it holds."""

    key: str
    nan: int
    inf: int
    numel: int

    def said(self) -> str:
        return f"{self.key} ({self.nan} NaN, {self.inf} inf of {self.numel})"


def _tensors(obj: Any, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every floating-point tensor under `obj`, DTensors as their local
    shard, in the state dict's order."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel():
            yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{key}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{key}.{i}")


def _screen(t: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor that is non-finite when `t` holds a non-finite value (and, rarely, when
    a sum of finite values overflows)."""
    dtype = _SUM_AS.get(t.dtype)
    if dtype is None:  # float8 and other rare types: no sum kernel everywhere
        ok = torch.isfinite(t.to(torch.float32)).all()
        return torch.zeros((), device=t.device).masked_fill(~ok, float("nan"))
    return t.sum(dtype=dtype).to(torch.float32)


def find_nonfinite(sd: dict[str, Any]) -> list[NonFinite]:
    """The tensors under `sd`'s CHECKED entries that hold a NaN or an infinity, with their
    counts, in the state dict's order; [] when every value is finite."""
    found = [(k, t) for entry in CHECKED if entry in sd for k, t in _tensors(sd[entry], entry)]
    if not found:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(found):
        by_device.setdefault(t.device, []).append(i)
    flagged: list[int] = []
    with torch.no_grad():
        for idx in by_device.values():
            sums = torch.stack([_screen(found[i][1]) for i in idx])
            bad = torch.nonzero(~torch.isfinite(sums)).flatten().tolist()  # one sync per device
            flagged += [idx[j] for j in bad]
        offenders: list[NonFinite] = []
        for i in sorted(flagged):
            key, t = found[i]
            t = t if t.dtype in _SUM_AS else t.to(torch.float32)
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:  # else a sum of finite values that overflowed
                offenders.append(NonFinite(key=key, nan=nan, inf=inf, numel=t.numel()))
    return offenders


def check_agreed(
    sd: dict[str, Any],
    step: int,
    collectives: Collectives,
    log: Any,
    newest_valid: int | None,
    unchecked: frozenset[str] = frozenset(),
) -> float:
    """Check this rank's part of the state dict `sd` of a save of `step` and agree with every
    rank of `collectives`; the seconds this rank's check took. `newest_valid`: the newest
    committed step, for the event and the error.

    When any rank found a non-finite value, every rank logs `ckpt.save.nonfinite` and raises
    NumericalFaultError before anything of the save is written. In the same gather the ranks
    compare the fingerprints of their plain values (duplicates.py, all but the keys
    `unchecked`): two ranks holding different values under one name raise
    DivergentStateError on every rank, logged as `ckpt.save.divergent`, nothing written. A
    collective: every rank calls it at the same point of the same save.
    """
    t0 = time.perf_counter()
    mine: tuple[list[NonFinite], str | None, dict[str, str]]
    try:
        prints = fingerprints(sd, unchecked) if collectives.world_size > 1 else {}
        mine = (find_nonfinite(sd), None, prints)
    except Exception as e:  # never leave the other ranks waiting in the gather below
        mine = ([], f"rank {collectives.rank}: {type(e).__name__}: {e}", {})
    seconds = time.perf_counter() - t0
    every = collectives.gather_all(mine)
    failed = [err for _, err, _ in every if err]
    if failed:
        raise NumericalFaultError(
            f"step {step}: the check for non-finite values failed, so nothing was written: "
            + "; ".join(failed)
        )
    ranks = [r for r, (found, _, _) in enumerate(every) if found]
    if not ranks:
        differ = divergent([p for _, _, p in every])
        if differ:
            log.error(
                "ckpt.save.divergent",
                step=step,
                keys=len(differ),
                first={k: differ[k] for k in sorted(differ)[:8]},
            )
            raise DivergentStateError(refusal(step, differ))
        return seconds
    offenders = [(r, f) for r, (found, _, _) in enumerate(every) for f in found]
    keys = [f"rank {r}: {f.said()}" for r, f in offenders[:8]]
    log.error(
        "ckpt.save.nonfinite",
        step=step,
        ranks=ranks,
        tensors=len(offenders),
        keys=keys,
        nan=sum(f.nan for _, f in offenders),
        inf=sum(f.inf for _, f in offenders),
        newest_valid=newest_valid,
    )
    newest = "none yet" if newest_valid is None else f"step {newest_valid}"
    more = ", ..." if len(offenders) > 3 else ""
    raise NumericalFaultError(
        f"step {step}: the model or optimizer state holds non-finite values on rank(s) "
        f"{ranks} ({len(offenders)} tensor(s): {'; '.join(keys[:3])}{more}); nothing was "
        "written. A non-finite state is not a storage error: the save is not retried, and "
        "on_save_error='continue' does not apply. The newest good checkpoint stays the "
        f"newest valid one ({newest}); resume from it and fix the data or the model"
    )
