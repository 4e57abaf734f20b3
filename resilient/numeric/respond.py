"""What the run does about an agreed numerical fault: a pure rule, and its record.

The first time a step fails, nothing tells a flipped bit or a glitching rank from bad data:
the run rolls back and replays it (in place from a snapshot, or cold from the newest
checkpoint when the loop cannot roll back). A step that fails again on the same inputs is
persistent: the data or the model. `policy="stop"` then ends the run (exit code
NUMERICAL_FAULT, do not requeue) and "skip" skips that step's update, up to `max_skips`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RESTART", "ROLLBACK", "SKIP", "STOP", "FaultLedger", "decide"]

ROLLBACK, RESTART, SKIP, STOP = "rollback", "restart", "skip", "stop"


def decide(
    *, times_seen: int, policy: str, skips_used: int, max_skips: int, can_roll_back: bool
) -> str:
    """The action for a fault seen `times_seen` times at its step (this one included)."""
    if times_seen <= 1:
        return ROLLBACK if can_roll_back else RESTART
    if policy == "skip" and skips_used < max_skips:
        return SKIP
    return STOP


@dataclass(slots=True)
class FaultLedger:
    """Faults seen per step in this run: this process's, and those recorded durably by
    earlier attempts (the checkpoint location's record), so a fault that comes back after a
    cold restart counts as seen twice."""

    seen: dict[int, int] = field(default_factory=dict)
    strikes: dict[int, int] = field(default_factory=dict)
    """rank -> transient faults it was among (a rank with repeated strikes is suspect)."""

    def count(self, step: int) -> int:
        self.seen[step] = self.seen.get(step, 0) + 1
        return self.seen[step]

    def adopt(self, steps: list[int]) -> None:
        """Steps recorded by earlier attempts (each counts once)."""
        for s in steps:
            self.seen[s] = max(self.seen.get(s, 0), 1)

    def strike(self, ranks: list[int]) -> dict[int, int]:
        for r in ranks:
            self.strikes[r] = self.strikes.get(r, 0) + 1
        return {r: self.strikes[r] for r in ranks}
