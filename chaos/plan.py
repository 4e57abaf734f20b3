"""Planning a scenario: where each fault lands, and how long the run may take.

A fault lands in a launch (a preemption ends one), at a restart count within it, and in an
attempt overall (the n-th `runtime.init` of a rank). The time bound is invariant (d): twice
the fault-free run plus, for each fault, its detection bound under the watchdog settings the
harness runs with (`_WATCHDOG`) and a restart allowance.
"""

from __future__ import annotations

from dataclasses import dataclass

from chaos.scenario import (
    PREEMPTIONS,
    Fault,
    Scenario,
    expected_recovery,
    replaces_process,
)

__all__ = ["_WATCHDOG", "Planned", "plan", "time_bound_s", "watchdog_for"]


_WATCHDOG = {
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 5.0,
    "timeout_s": 10.0,
    "startup_timeout_s": 120.0,
    "checkpoint_timeout_s": 60.0,
}


_MESH_WATCHDOG = {**_WATCHDOG, "heartbeat_timeout_s": 10.0, "timeout_s": 30.0}
"""For 4-rank mesh scenarios (recipes/train_nd.py): four ranks share two cores and a tensor-
parallel step runs DTensor's dispatch, so a step takes 0.5-2.5 s and the first one up to
11 s of work (measured at a load of 18-40 from other jobs); 10 s for a phase named healthy
ranks stalled at step 0 (mesh-tp-hot, 2026-11-27). Scaled up as the base is scaled down."""


def watchdog_for(sc: Scenario) -> dict[str, float]:
    """The watchdog settings a scenario's runs get (RESILIENT_WATCHDOG)."""
    return dict(_MESH_WATCHDOG if sc.mesh else _WATCHDOG)


_RESTART_ALLOWANCE_S = 60.0
"""Bound (d): a new attempt's start-up (interpreters, torch import, process groups, load)
and replay on a loaded 2-core machine, where start-up alone was seen to take 14 s."""


def _detect_bound_s(kind: str, sc: Scenario) -> float:
    """How long a fault of `kind` may take to end its attempt, from the timeouts in force."""
    wd = watchdog_for(sc)
    beat = wd["heartbeat_interval_s"]
    if kind == "hang":  # a live rank past its phase timeout, then the exit grace
        return wd["timeout_s"] + 3 * beat + 1.0
    if kind in PREEMPTIONS:
        return sc.grace_s
    if kind in ("storage_errors", "storage_latency"):  # retried within the save's budget
        return 30.0
    # dead or stopped: a missing heartbeat (a peer's socket error is usually faster)
    return wd["heartbeat_timeout_s"] + 3 * beat + 1.0


def time_bound_s(sc: Scenario, golden_wall_s: float) -> float:
    """(d): twice the fault-free run, plus for each fault its detection bound and a restart."""
    per_fault = sum(_detect_bound_s(f.kind, sc) + _RESTART_ALLOWANCE_S for f in sc.faults)
    return min(sc.timeout_s, 2 * golden_wall_s + per_fault + 30.0)


@dataclass(slots=True)
class Planned:
    """Where a fault lands: launch (a preemption ends one), restart count within it, and the
    attempt overall (the n-th `runtime.init` of a rank)."""

    fault: Fault
    launch: int
    restart: int
    attempt: int
    expect: str = "cold"
    """The recovery that must follow (chaos.scenario.expected_recovery)."""
    generation: int = 0
    """The hot-recovery generation within the attempt (RESILIENT_GENERATION): one more
    after each lost process recovered hot, 0 again after a cold restart."""

    @property
    def restarts(self) -> bool:
        """Ends the attempt: a cold restart of the group (or, for a preemption, a relaunch);
        a bad batch in cold mode restarts once before its skip or stop ("cold then skip")."""
        return self.expect == "cold" or self.expect.startswith("cold then ")


def plan(sc: Scenario) -> list[Planned]:
    out, launch, restart, attempt, gen = [], 0, 0, 0, 0
    for f in sorted(sc.faults, key=lambda f: f.at_step):
        policy = "skip" if f.at_step in sc.skip_steps() else "stop"  # for a bad batch
        expect = expected_recovery(f, sc.hot, sc.recipe, policy=policy)
        p = Planned(f, launch, restart, attempt, expect, gen)
        out.append(p)
        if f.kind in PREEMPTIONS or f.kind == "resize":  # the runner launches again
            launch, restart, attempt, gen = launch + 1, 0, attempt + 1, 0
        elif p.restarts:
            restart, attempt, gen = restart + 1, attempt + 1, 0
        elif replaces_process(f, sc.hot, sc.recipe):
            gen += 1
    return out
