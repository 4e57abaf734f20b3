"""Named fault points: the few places where a fault-injection harness may act inside a rank
or its launcher.

The chaos harness (chaos/faults.py, chaos/supervise.py) kills, stops or raises in a rank at
exact moments: as it enters a phase of a step, in the middle of an in-memory snapshot, between
the two halves of a replica exchange, on a survivor's way out of its generation, on a rank's
way into a hot recovery's next one, or right after the launcher's agent looked at its workers.
Production code names
those moments here and calls `hit()` there; the harness `arm()`s an action on a name. Moving
code carries its `hit()` along, so a fault can never be silently disarmed by a refactor, and
an unknown name is an error at `arm()`.

Unarmed, a point costs one truth test of a module-level dict: nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PHASE_ENTER = "phase.enter"
SNAPSHOT_COPIED = "snapshot.copied"
REPLICA_HEADERS = "replica.headers"
HOT_LEFT = "hot.left"
HOT_ROLL_CALL = "hot.roll_call"
AGENT_LOOKED = "agent.looked"

POINTS: dict[str, str] = {
    PHASE_ENTER: "a rank's main thread entered a phase (step=, phase=: a Phase), after the "
    "heartbeat state moved (hang/phases.py)",
    SNAPSHOT_COPIED: "an in-memory snapshot's copy is made and not yet marked held (step=; "
    "memory/snapshot.py)",
    REPLICA_HEADERS: "a buddy-replica exchange sent and received its headers, no tensor has "
    "crossed yet (step=; memory/replica.py, on the replica thread)",
    HOT_LEFT: "a survivor left its generation (the worker wrapper caught HotRestart) and has "
    "not yet collected the unwound script's garbage (generation=: the one it goes to; "
    "worker.py)",
    HOT_ROLL_CALL: "a rank enters the roll call of a hot recovery's generation, before its "
    "process groups form (generation=; hot/reform.py)",
    AGENT_LOOKED: "the supervisor's agent looked at its workers' exits and acts on them next "
    "(pids=: local rank -> pid; supervisor/agent.py, in the launcher's process)",
}
"""Every point, with what has happened when it is hit and the keyword arguments it passes."""

armed: dict[str, Callable[..., None]] = {}
"""Point name -> the action to run there. Empty in production."""


def arm(point: str, action: Callable[..., None]) -> None:
    """Run `action(**where)` each time `point` is hit in this process."""
    if point not in POINTS:
        raise KeyError(f"no fault point {point!r}; the points are {sorted(POINTS)}")
    armed[point] = action


def disarm(point: str | None = None) -> None:
    """Disarm `point`, or every point."""
    if point is None:
        armed.clear()
    else:
        armed.pop(point, None)


def hit(point: str, **where: Any) -> None:
    """Production code passes `point`: run its action, if one is armed."""
    if armed:
        action = armed.get(point)
        if action is not None:
            action(**where)
