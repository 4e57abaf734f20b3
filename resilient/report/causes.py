"""What caused a recovery, as the run's own events tell it (no chaos harness needed).

A recovery's window (from the recovery before it to this one) holds the events of its fault's
detection. The first that names a cause, in this order, gives the kind, the fault's time and
the time it was detected:

- `numeric.fault`: "numeric", at the step it names (seen at that step's check: detected then);
- a watchdog verdict (`hang.detected`, `fault.detected`): a rank that made no progress,
  "hang"; one whose heartbeat stopped, "stopped" when its process was found stopped
  (SIGSTOP), "lost process" when it was gone, else "no heartbeat"; a rank that flagged its
  own failure, "oom" or "exception". The fault is dated at the named rank's last heartbeat
  (or last progress, for a hang): the verdict says how long before it that was, so the
  detection time is the wait the group spent on the timeout, and the verdict says which
  timeout fired (learned, fixed, pinned, ..., with its value: `Cause.timeout`);
- `guard.failure`: "oom" or "exception", as the guard classified it (an OOM retry is
  "oom" by itself: recovery.py); a preemption's events: "preemption";
- a worker's exit (`worker.failed`, `recovery.hot.replace`, `watchdog.exit`): its code;
  killed by a signal, "lost process";
- a survivor that met a peer's loss (`recovery.hot.detect`, `guard.peer_error`): "lost
  process", dated there when that came before the exit was seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resilient import events as ev
from resilient.exitcodes import ExitCode

__all__ = ["Cause", "cause_of"]

_BY_CODE = {
    int(ExitCode.OOM): "oom",
    int(ExitCode.RANK_EXCEPTION): "exception",
    int(ExitCode.NUMERICAL_FAULT): "numeric",
    int(ExitCode.HANG): "hang",
    int(ExitCode.PREEMPTED): "preemption",
    int(ExitCode.PEER_LOST): "lost process",
}
_PREEMPT = {"preempt.forward", "worker.preempted", ev.PREEMPT_STOP, ev.PREEMPT_EXIT}
_EXITS = {ev.WORKER_FAILED, ev.RECOVERY_HOT_REPLACE}
_MET = {ev.RECOVERY_HOT_DETECT, "guard.peer_error"}


@dataclass(frozen=True, slots=True)
class Cause:
    kind: str
    fault_t: float
    """When the fault happened, as far as the events tell (an estimate)."""
    detect_t: float
    """When the run knew of it (the event that named it)."""
    step: int | None = None
    """The step it was seen at (numeric faults)."""
    timeout: str | None = None
    """For a watchdog verdict, the rule that fired: "learned 5.00 s", "fixed 300.00 s",
    "pinned 60.00 s", "first_step 360.00 s", "startup ...", "heartbeat learned 10.20 s"
    (no beat for that long; learned from the beats' gaps, or fixed: heartbeat_timeout_s),
    "process state" (its agent saw it stopped), "barrier"."""


def cause_of(window: list[dict[str, Any]]) -> Cause | None:
    """The cause the events of one recovery's window name (None: they name none)."""
    window = sorted(window, key=lambda e: e["t"])
    for rule in (_numeric, _verdict, _guard, _preempted, _exited, _met_loss):
        found = rule(window)
        if found is not None:
            return found
    return None


def _first(window: list[dict[str, Any]], names: set[str]) -> dict[str, Any] | None:
    return next((e for e in window if e.get("event") in names), None)


def _numeric(window: list[dict[str, Any]]) -> Cause | None:
    e = _first(window, {"numeric.fault"})
    if e is None:
        return None
    step = e.get("step")
    return Cause("numeric", e["t"], e["t"], int(step) if step is not None else None)


def _verdict(window: list[dict[str, Any]]) -> Cause | None:
    e = _first(window, {ev.HANG_DETECTED, "fault.detected"})
    if e is None:
        return None
    named = [n for n in e.get("named") or [] if isinstance(n, dict)]
    verdict = str(e.get("kind", ""))
    age_key = "progress_age_s"
    if verdict == "no_heartbeat":
        states = {n.get("state") for n in named}
        kind = "stopped" if "stopped" in states else None
        kind = kind or ("lost process" if states & {"dead", "zombie"} else None)
        kind, age_key = kind or "no heartbeat", "silent_s"
    elif verdict == "failed":
        kind = "oom" if any(n.get("oom") for n in named) else "exception"
    elif verdict in ("stalled", "barrier"):
        kind = "hang"
    else:  # store_lost and others: what the verdict's exit code means
        kind = _BY_CODE.get(int(e.get("exit_code", -1)), verdict or "unknown")
    ages = [float(n[age_key]) for n in named if n.get(age_key) is not None]
    age = max(ages) if ages and kind != "exception" and kind != "oom" else 0.0
    return Cause(kind, e["t"] - age, e["t"], _step(named), _timeout(verdict, named))


def _timeout(verdict: str, named: list[dict[str, Any]]) -> str | None:
    """Which timeout a verdict's first named rank was judged by, and its value."""
    first = named[0] if named else {}
    if first.get("timeout_kind") == "process_state":
        return "process state"
    if verdict == "no_heartbeat":
        if first.get("heartbeat_timeout_s") is None:
            return "heartbeat"
        kind = first.get("heartbeat_timeout_kind", "fixed")
        return f"heartbeat {kind} {float(first['heartbeat_timeout_s']):.2f} s"
    if verdict == "barrier":
        return "barrier"
    if verdict != "stalled" or first.get("timeout_s") is None:
        return None
    return f"{first.get('timeout_kind', 'fixed')} {float(first['timeout_s']):.2f} s"


def _step(named: list[dict[str, Any]]) -> int | None:
    steps = [int(n["step"]) for n in named if n.get("step") is not None]
    return min(steps) if steps else None


def _guard(window: list[dict[str, Any]]) -> Cause | None:
    e = _first(window, {"guard.failure"})
    if e is None:
        return None
    return Cause("oom" if e.get("kind") == "oom" else "exception", e["t"], e["t"])


def _preempted(window: list[dict[str, Any]]) -> Cause | None:
    e = _first(window, _PREEMPT)
    return None if e is None else Cause("preemption", e["t"], e["t"])


def _exited(window: list[dict[str, Any]]) -> Cause | None:
    exits = [e for e in window if e.get("event") in _EXITS and e.get("exit_code") is not None]
    exits += [  # a rank's own exit: the code it left with (not a peer's loss it met)
        e
        for e in window
        if e.get("event") == "watchdog.exit" and e.get("code") not in (None, ExitCode.PEER_LOST)
    ]
    if not exits:
        return None
    e = min(exits, key=lambda x: x["t"])
    code = int(e.get("exit_code", e.get("code", -1)))
    kind = "lost process" if code < 0 else _BY_CODE.get(code, f"exit {code}")
    if kind == "lost process":  # a survivor may have met the loss before the exit was seen
        met = _first(window, _MET)
        if met is not None and met["t"] < e["t"]:
            return Cause(kind, met["t"], met["t"])
    return Cause(kind, e["t"], e["t"])


def _met_loss(window: list[dict[str, Any]]) -> Cause | None:
    e = _first(window, _MET)
    return None if e is None else Cause("lost process", e["t"], e["t"])
