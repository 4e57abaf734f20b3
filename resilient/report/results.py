"""What the analysis finds: a RunReport, a FaultReport per recovery, and the recovery kinds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COLD",
    "HOT_REPLACEMENT",
    "HOT_ROLLBACK",
    "MEMBERSHIP",
    "RETRY",
    "FaultReport",
    "RunReport",
]

HOT_ROLLBACK = "hot rollback"
"""Every rank rolled back in place to an in-memory snapshot; no process lost."""
HOT_REPLACEMENT = "hot replacement"
"""A lost process was replaced warm; the survivors re-formed their groups."""
RETRY = "oom retry"
"""The OOM guard retried the batch in smaller micro-batches, in place."""
COLD = "cold restart"
"""The group was restarted: fresh processes, the newest checkpoint."""
MEMBERSHIP = "membership change"
"""Not a fault: a node joined, so the agents stopped the healthy group (it saved on its way
out) and started it again in the larger world. Kept apart from the faults (MTBF, restart
cost)."""


@dataclass(slots=True)
class FaultReport:
    attempt: int
    """The attempt (restart count) the fault came in; a cold restart ended it."""
    kind: str
    fault_t: float
    exact_time: bool
    detect_s: float | None
    """Fault to the first detection event (or to the new attempt's start)."""
    restart_s: float | None
    """Fault to the new attempt's resumed state (detection, restart, load)."""
    recover_s: float | None
    """Fault to the first completed step of the new attempt."""
    steps_lost: int | None
    """Steps completed before the fault that had to be run again (a lower bound when the
    failed attempt's last progress event was lost with it)."""
    recovery: str = COLD
    """COLD, HOT_ROLLBACK, HOT_REPLACEMENT, RETRY, or MEMBERSHIP (RunReport.membership)."""
    step: int | None = None
    """The step a numerical fault was seen at (None for other kinds)."""
    timeout: str | None = None
    """A hang's: which timeout fired and its value ("learned 5.00 s", causes.py)."""

    @property
    def label(self) -> str:
        """The kind as the report prints it (a numerical fault with its step)."""
        return self.kind if self.step is None else f"{self.kind} @{self.step}"


@dataclass(slots=True)
class RunReport:
    wall_s: float
    productive_s: float
    goodput: float
    final_step: int
    attempts: int
    step_s: float | None
    save_cost_s: float | None
    saves: int
    faults: list[FaultReport] = field(default_factory=list)
    membership: list[FaultReport] = field(default_factory=list)
    """Restarts for a node that joined (recovery MEMBERSHIP): their cost, not faults."""
    mtbf_s: float | None = None
    restart_cost_s: float | None = None
    optimal_interval_s: float | None = None
    optimal_goodput: float | None = None
    interval_s: float | None = None
    blocked_s: float | None = None
    """Median time a save kept the loop in save() (staging; a sync save's whole time)."""
    save_cost_basis: str = "blocked"
    """"effective" (blocked + fence + slowdown, from step times), "given" (analyze's
    `save_cost_s`, when this run has no clean window) or "blocked"."""
    save_slowdown_s: float = 0.0
    """Step time the saves cost beyond the reference (fence waits, slower steps); not
    counted as productive."""
    step_overhead_s: float | None = None
    """Median time per step spent between step bodies (the runtime's own per-step work)."""
    startup_s: float = 0.0
    """From the first event to the start of the first step of attempt 0."""
    end_s: float = 0.0
    """From the end of the last step to the last event (final save, exit)."""
    replayed_s: float = 0.0
    """Step time of steps that a later attempt ran again."""
    optimal_run_goodput: float | None = None
    """The optimum with this run's one-time start-up and end added."""
    replay_verified: list[tuple[int, int]] = field(default_factory=list)
    """(rank, steps) of each `resume.verified`: replayed steps equal to the earlier run's."""
    replay_diverged: list[dict[str, Any]] = field(default_factory=list)
    """Each `resume.diverged`: the first replayed step that differed, on which rank, what."""
    numeric: list[dict[str, Any]] = field(default_factory=list)
    """Each numerical fault (rank 0's `numeric.fault`): step, origin ranks, what was seen,
    times seen at that step, and the action (rollback, restart, skip, stop)."""
    skipped: list[tuple[int, int]] = field(default_factory=list)
    """Ranges (first, last) of the steps whose update was skipped."""
    suspects: dict[int, int] = field(default_factory=dict)
    """rank -> transient numerical faults it was the origin of (more than one: suspect)."""
    hang_timeouts: dict[str, float] = field(default_factory=dict)
    """The learned hang timeouts in force at the end (rank 0's newest `hang.timeouts`)."""
    hang_pinned: list[str] = field(default_factory=list)
    """The phases whose hang timeout the configuration pins (never learned)."""

    @property
    def steady_goodput(self) -> float:
        """Goodput with the one-time start-up and end left out of the wall time."""
        steady = self.wall_s - self.startup_s - self.end_s
        return self.productive_s / steady if steady > 0 else 0.0

    @property
    def goodput_over_optimum(self) -> float | None:
        if not self.optimal_run_goodput:
            return None
        return self.goodput / self.optimal_run_goodput
