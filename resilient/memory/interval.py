"""The adaptive snapshot interval: how often a rank can copy its state and stay in budget.

The copy's time over the step's time is kept under `budget` (2% by default): snapshot every
power-of-two number of steps that keeps it there (1 on small models), from the medians of the
last `WINDOW` copies and steps. With buddy replication (sharded state under hot recovery) the
cost also holds what the exchange in the background takes from the steps it overlaps,
measured, not modelled: the median of the recent steps that overlapped one less the median of
those that did not, times the steps one exchange overlaps (their mean), and at most the
exchange's own duration. On a host with idle cores that difference is about zero; on one whose
cores all train it is most of the cost. To have steps of both kinds to compare, the interval is
at least 2 while replicating until the first measurement, and it comes down by at most half
at each agreement while an exchange costs anything.

Pure: `Measurements` records, `wanted_interval` decides; memory/snapshot.py agrees the
result across ranks (MAX) and carries it out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MAX_EVERY", "WINDOW", "Measurements", "exchange_cost", "wanted_interval"]

WINDOW = 32
"""Recent step and copy times the interval takes the median of."""
MAX_EVERY = 1024


def _push(values: list[Any], value: Any) -> list[Any]:
    return [*values[-(WINDOW - 1) :], value]


@dataclass
class Measurements:
    """The recent times the interval is decided from (the last WINDOW of each)."""

    step_s: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    """Steps during which a replica exchange ran."""
    clean_s: list[float] = field(default_factory=list)
    """Steps during which none ran."""
    spans: list[int] = field(default_factory=list)
    """Steps each recent exchange overlapped."""
    exchange_wall: list[float] = field(default_factory=list)
    """Wall seconds of recent exchanges."""

    def step(self, seconds: float, *, exchanging: bool) -> None:
        self.step_s = _push(self.step_s, seconds)
        if exchanging:
            self.busy_s = _push(self.busy_s, seconds)
            if self.spans:
                self.spans[-1] += 1
        else:
            self.clean_s = _push(self.clean_s, seconds)

    def copy(self, seconds: float) -> None:
        self.copy_s = _push(self.copy_s, seconds)

    def exchange_started(self) -> None:
        self.spans = _push(self.spans, 0)

    def exchange_took(self, seconds: float) -> None:
        self.exchange_wall = _push(self.exchange_wall, seconds)

    def as_dict(self) -> dict[str, list[Any]]:
        return asdict(self)

    @classmethod
    def from_dict(cls, lists: dict[str, list[Any]] | None) -> Measurements:
        return cls(**{k: list(v) for k, v in (lists or {}).items()})


def exchange_cost(m: Measurements, *, replicating: bool) -> float | None:
    """Step time that one replica exchange costs (module doc); None before steps with and
    without one were both seen, and 0 when nothing is replicated."""
    if not replicating:
        return 0.0
    if not (m.busy_s and m.clean_s and m.spans):
        return None
    extra = statistics.median(m.busy_s) - statistics.median(m.clean_s)
    cost = max(0.0, extra) * statistics.fmean(m.spans)
    if m.exchange_wall:  # it cannot have held the steps up longer than it ran
        cost = min(cost, statistics.median(m.exchange_wall))
    return cost


def wanted_interval(
    m: Measurements, *, budget: float, current: int, replicating: bool
) -> tuple[int, float | None]:
    """The power of two that keeps this rank's snapshot cost under `budget` of a step, at
    most MAX_EVERY, and the exchange cost it weighed (None: not measured yet)."""
    want = 1
    exchange_s = exchange_cost(m, replicating=replicating)
    if m.copy_s and m.step_s:
        copy_s = statistics.median(m.copy_s)
        step_s = statistics.median(m.clean_s or m.step_s)
        cost = copy_s + (exchange_s or 0.0)
        ratio = cost / (budget * step_s) if step_s > 0 else 1.0
        want = 1 if ratio <= 1 else 2 ** math.ceil(math.log2(ratio))
    if exchange_s is None:
        want = max(want, 2)  # steps without an exchange, to measure what one costs
    elif exchange_s > 0:
        # step times are noisy: one quiet window must not take the interval from 16 to 1 at
        # once (it may rise at once: that keeps the budget)
        want = max(want, current // 2)
    return min(want, MAX_EVERY), exchange_s
