"""The Young/Daly optimum of the checkpoint interval, and the goodput it gives.

With checkpoint cost C, restart cost R (fault to the resumed state) and mean time between
failures M, the best interval is about sqrt(2 C M) (Daly's higher-order form is used) and the
best goodput about 1 - C/tau - (tau/2 + R)/M (first order; Daly 2006).
That is a steady state: it has no one-time start-up before step 0 and no final save and exit,
which every run pays once whatever its interval. `optimal_run_goodput` adds this run's own
start-up and end to the optimum (the same productive work P takes P / optimum + start-up + end)
and `goodput_over_optimum` compares the measured goodput with it; `steady_goodput` leaves
start-up and end out of the measured wall time instead (the two ratios are close).
"""

from __future__ import annotations

import math

__all__ = ["young_daly"]


def _daly(c: float, m: float) -> float:
    """Daly's (2006) higher-order optimum of the compute time between checkpoints."""
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def young_daly(c: float, r: float, m: float) -> tuple[float, float]:
    """(optimal interval, optimal goodput) for save cost c, restart cost r and MTBF m."""
    tau = _daly(c, m)
    return tau, max(0.0, 1 - c / tau - (tau / 2 + r) / m)
