"""The run's goodput so far, by the definition of `resilient report` (report/goodput.py):
time in step bodies that count towards the final state over the wall time from the run's
first event to its newest.

The analysis runs on what the follower has read so far, in the supervisor's monitor thread
(never in a worker), at most every `every_s` seconds, and never more often than 20 times its
own duration, so that on a long run it costs the node at most 5 % of one core. Kept for it:
every event but the per-step fingerprints and the progress windows of ranks other than 0
(the analysis reads rank 0's); the first and the newest event left out are kept too, so
the wall time is the report's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resilient import events as ev
from resilient.report.goodput import analyze_events, prepare_events

__all__ = ["Goodput", "GoodputTracker"]

_DUTY = 20.0
"""Wait at least this many times the last analysis' duration before the next."""


@dataclass(frozen=True, slots=True)
class Goodput:
    goodput: float
    productive_s: float
    wall_s: float
    recoveries: int
    """Recoveries the report found (cold restarts and hot ones)."""
    at: float
    """When it was computed (clock time)."""


class GoodputTracker:
    def __init__(self, *, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self._clock = clock
        self._kept: list[dict[str, Any]] = []
        self._first_dropped: dict[str, Any] | None = None
        self._last_dropped: dict[str, Any] | None = None
        self._due = 0.0
        self._dirty = False
        self._rank0 = False
        self.last: Goodput | None = None
        self.cost_s = 0.0
        """The last analysis' duration."""

    def add(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e.get("event") == ev.STEP_FINGERPRINT or (
                e.get("event") == ev.TRAIN_PROGRESS and e.get("rank") != 0
            ):
                t = e["t"]
                if self._first_dropped is None or t < self._first_dropped["t"]:
                    self._first_dropped = e
                if self._last_dropped is None or t > self._last_dropped["t"]:
                    self._last_dropped = e
            else:
                self._kept.append(e)
                self._rank0 = self._rank0 or e.get("rank") == 0
        self._dirty = self._dirty or bool(events)

    def update(self, *, force: bool = False) -> Goodput | None:
        """Analyse again when due (or `force`) and something new came; the newest result."""
        now = self._clock()
        if not self._dirty or (now < self._due and not force):
            return self.last
        t0 = time.perf_counter()
        edges = [e for e in (self._first_dropped, self._last_dropped) if e is not None]
        try:
            rep = analyze_events(prepare_events([*self._kept, *edges]))
        except (ValueError, KeyError, TypeError, ZeroDivisionError):
            rep = None  # not enough yet (no step), or an event the analysis cannot use
        self.cost_s = time.perf_counter() - t0
        self._due = now + max(self.every_s, _DUTY * self.cost_s)
        self._dirty = False
        if rep is not None and self._rank0:
            self.last = Goodput(
                goodput=rep.goodput,
                productive_s=rep.productive_s,
                wall_s=rep.wall_s,
                recoveries=len(rep.faults),
                at=now,
            )
        return self.last
