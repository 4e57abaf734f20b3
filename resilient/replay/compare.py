"""Replay verification: per-step fingerprints compared across attempts and across runs.

A step's fingerprint (written by the runtime as a `step.fingerprint` event, see
resilient/replay/fingerprint.py) is a hash of the first forward inputs of the tracked model
in that step, plus the loss if the script handed it over with `rt.observe(loss=...)`. An exact
resume runs the steps after its checkpoint again on the same inputs with the same loss; the
first step where they differ is where the resumed run stopped being the same run. The
functions here only read events: the runtime's online check, `resilient check-resume` and
the chaos checker share them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from resilient import events as ev

__all__ = [
    "CAUSES",
    "Divergence",
    "Fingerprint",
    "across_attempts",
    "compare",
    "fingerprints",
]

Fingerprint = tuple[str, float | None]
"""(hash of the step's first forward inputs, loss or None)."""

CAUSES = {
    "inputs": (
        "the step's first forward got other inputs than in the earlier run. Likely: data drawn "
        "before steps()/epochs() or carried from one step into the next (a batch prefetched at "
        "the end of a step lives in a local variable that no checkpoint holds: fetch it at the "
        "start of the step), a torch.Generator or data source that is not tracked (pass it to "
        "track() as an extra), or iterating the loader itself instead of rt.batches()"
    ),
    "loss": (
        "same inputs, other loss. Likely: model, optimizer or other state outside track() (an "
        "EMA, a GradScaler, buffers changed outside the step), an RNG or generator that is not "
        "restored (dropout on a torch.Generator of your own), or nondeterministic kernels "
        "(torch.use_deterministic_algorithms(True) finds them)"
    ),
}


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first step whose fingerprint differs from the earlier run's."""

    step: int
    differed: str
    """"inputs" or "loss"."""
    before: Any
    now: Any
    rank: int | None = None

    @property
    def causes(self) -> str:
        return CAUSES[self.differed]

    def describe(self) -> str:
        where = "" if self.rank is None else f" on rank {self.rank}"
        return (
            f"step {self.step}{where}: the {self.differed} differ from the earlier run "
            f"({self.before} before, {self.now} now): {self.causes}"
        )


def _same_loss(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return True  # not handed over in one of them: nothing to compare
    return a == b or (math.isnan(a) and math.isnan(b))


def compare(
    before: dict[int, Fingerprint], after: dict[int, Fingerprint], rank: int | None = None
) -> tuple[int, Divergence | None]:
    """(steps compared, the first divergence or None), over the steps both have."""
    n = 0
    for step in sorted(set(before) & set(after)):
        (bi, bl), (ai, al) = before[step], after[step]
        if bi != ai:
            return n, Divergence(step, "inputs", bi, ai, rank)
        if not _same_loss(bl, al):
            return n, Divergence(step, "loss", bl, al, rank)
        n += 1
    return n, None


def _fp(e: dict[str, Any]) -> Fingerprint:
    loss = e.get("loss")
    return str(e["inputs"]), None if loss is None else float(loss)


def fingerprints(
    events: Iterable[dict[str, Any]], *, shape: tuple[int, str] | None = None
) -> dict[int, Fingerprint]:
    """Step -> fingerprint from `step.fingerprint` events (the later of two wins); with
    `shape`, only those recorded on that (world size, mesh layout)."""
    out: dict[int, Fingerprint] = {}
    for e in events:
        if e.get("event") != ev.STEP_FINGERPRINT:
            continue
        if shape is not None and (e.get("world"), e.get("mesh", "")) != shape:
            continue
        out[int(e["step"])] = _fp(e)
    return out


def across_attempts(rank_events: Iterable[dict[str, Any]]) -> tuple[int, Divergence | None]:
    """Replay check over one rank's whole log: each attempt that resumed from a checkpoint at
    step S is compared, from S on, with what the attempts before it recorded (the newest
    record of a step wins; only on the same world size and mesh layout). A fresh start
    forgets the past. Returns (steps compared, first divergence)."""
    # step -> (fingerprint, (world size, mesh layout))
    earlier: dict[int, tuple[Fingerprint, tuple[int, str]]] = {}
    current: dict[int, tuple[Fingerprint, tuple[int, str]]] = {}
    resumed_at: int | None = None
    total, first = 0, None

    def settle() -> None:
        nonlocal total, first
        if resumed_at is not None and current:
            for w in {w for _, w in current.values()}:
                before = {s: f for s, (f, ww) in earlier.items() if ww == w and s >= resumed_at}
                after = {s: f for s, (f, ww) in current.items() if ww == w}
                n, div = compare(before, after)
                total += n
                if div is not None and (first is None or div.step < first.step):
                    first = div
        earlier.update(current)
        current.clear()

    for e in rank_events:
        name = e.get("event")
        if name == ev.RUNTIME_INIT:  # each process logs one: a new attempt
            settle()
            resumed_at = None
        elif name == ev.RUNTIME_RESUME:
            if e.get("from_checkpoint"):
                resumed_at = int(e["step"])
            else:
                earlier.clear()
                resumed_at = None
        elif name == ev.STEP_FINGERPRINT:
            current[int(e["step"])] = (_fp(e), (int(e.get("world", 0)), str(e.get("mesh", ""))))
    settle()
    return total, first
