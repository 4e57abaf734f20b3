"""`train.progress` events: which steps ran when, batched to at most one event a second.

The run report computes goodput, recovery times and steps lost from them. The first step of
every attempt is logged at once, so the time to recover is exact; later steps are batched so
the cost stays at two clock reads per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["ProgressLog"]


class ProgressLog:
    def __init__(
        self, log: Any, *, every_s: float = 1.0, clock: Callable[[], float] = time.time
    ) -> None:
        self._log = log
        self._every = every_s
        self._clock = clock
        self._first: int | None = None
        self._last = 0
        self._t0 = 0.0
        self._t1 = 0.0
        self._t1_first = 0.0
        self._busy = 0.0
        self._step_t0 = 0.0
        self._logged_any = False

    def begin(self) -> None:
        self._step_t0 = self._clock()

    def end(self, step: int) -> None:
        """Step `step` (0-based) finished its body."""
        now = self._clock()
        if self._first is None:
            self._first, self._t0, self._t1_first, self._busy = step, self._step_t0, now, 0.0
        self._last, self._t1 = step, now
        self._busy += now - self._step_t0
        if not self._logged_any or now - self._t0 >= self._every:
            self.flush()

    def flush(self) -> None:
        if self._first is None:
            return
        self._log.info(
            "train.progress",
            first=self._first,
            last=self._last,
            t0=self._t0,
            t1=self._t1,
            t1_first=self._t1_first,
            busy_s=round(self._busy, 6),
        )
        self._first = None
        self._logged_any = True
