"""Each recovery of a run, from its events: what kind it was, its fault, and what it cost.

A recovery is a cold restart (a new attempt) or a hot one, in place (rank 0's rollback.done,
recovery.hot.formed or oom.retry). Each is matched with its own fault: the chaos harness's
`chaos.fault` when there is one (its kind and exact time), else the cause the run's own
events name (causes.py: the kind, and a time estimated from the logs). Its costs (detection,
restart to the resumed state, the first step completed after it, the steps run again) are
measured from that fault.

A cold restart whose attempt saw the agent's `restart.membership` (a node joined; torch
elastic stops a healthy group for it) had no fault: it is labelled MEMBERSHIP, timed from
the agent's decision, and matched with no chaos fault.
"""

from __future__ import annotations

from typing import Any

from resilient import events as ev
from resilient.report.causes import Cause, cause_of
from resilient.report.results import (
    COLD,
    HOT_REPLACEMENT,
    HOT_ROLLBACK,
    MEMBERSHIP,
    RETRY,
    FaultReport,
)

__all__ = ["recoveries"]

_HOT_DONE = {
    ev.ROLLBACK_DONE: HOT_ROLLBACK,
    ev.RECOVERY_HOT_FORMED: HOT_REPLACEMENT,
    ev.OOM_RETRY: RETRY,
}
_DETECT = set(ev.DETECTION) | {
    ev.ROLLBACK_AGREED,
    ev.ROLLBACK_REFUSED,
    ev.RECOVERY_HOT_DETECT,
    ev.RECOVERY_COLD,
    ev.OOM_RETRY,
    "numeric.fault",
}


def recoveries(
    events: list[dict[str, Any]],
    rank0: list[dict[str, Any]],
    inits: list[dict[str, Any]],
    resumes: dict[int, dict[str, Any]],
    progress: list[dict[str, Any]],
    attempts: list[int],
    chaos: list[dict[str, Any]],
    start: float,
    membership: list[float] | None = None,
) -> list[FaultReport]:
    """Every recovery of the run in time order: cold restarts (a new attempt) and hot ones
    (rank 0's rollback.done, recovery.hot.formed or oom.retry), each labelled by its own
    fault: the first chaos.fault since the recovery before it (without one, the fault time
    is estimated from the logs). `membership`: the times of the agents' restart.membership;
    a cold restart of an attempt that saw one is a MEMBERSHIP change, not a fault."""
    began: dict[int, float] = {}  # each attempt's first runtime.init (events are in time order)
    for e in inits:
        began.setdefault(int(e["restart"]), e["t"])
    marks: list[tuple[float, str, int, dict[str, Any] | None]] = []  # (t, kind, attempt, event)
    for a in attempts[:-1]:
        nxt = next((e for e in inits if int(e["restart"]) == a + 1), None)
        if nxt is not None:
            marks.append((nxt["t"], COLD, a, None))
    for e in rank0:
        kind = _HOT_DONE.get(str(e.get("event")))
        if kind is not None:
            marks.append((e["t"], kind, int(e.get("restart", 0)), e))
    marks.sort(key=lambda m: m[0])
    out: list[FaultReport] = []
    prev_t = start
    used: set[int] = set()
    for t, kind, a, done in marks:
        joined = (
            min((m for m in membership or () if began.get(a, start) <= m <= t), default=None)
            if kind == COLD
            else None
        )
        if joined is not None:  # the agent's own decision: no fault to look for, none detected
            kind, mine, cause, fault_t = MEMBERSHIP, [], None, joined
            detected = [joined]
        else:
            mine = [
                i for i, c in enumerate(chaos) if i not in used and prev_t - 0.001 <= c["t"] <= t
            ]
            if mine:
                used.add(mine[0])
            cause = cause_of([e for e in events if prev_t - 0.001 <= e["t"] <= t])
            if kind == RETRY:  # the guard's retry of an OOM names itself
                cause = Cause("oom", cause.fault_t if cause else t, cause.detect_t if cause else t)
            if kind == COLD:
                in_attempt = [
                    e["t"] for e in events if int(e.get("restart", -1)) == a and e["t"] <= t
                ]
                est = max(in_attempt, default=t)
            else:  # the agreement that named it, or the retry itself
                est = next(
                    (e["t"] for e in rank0 if prev_t <= e["t"] <= t and e.get("event") in _DETECT),
                    t,
                )
            if cause is not None:  # the run's own events date it (a hang: its last heartbeat)
                est = cause.fault_t
            fault_t = chaos[mine[0]]["t"] if mine else est
            detected = [
                e["t"]
                for e in events
                if e.get("event") in _DETECT and fault_t - 0.001 <= e["t"] <= t
            ]
        cold = kind in (COLD, MEMBERSHIP)
        if cold:
            resumed = resumes.get(a + 1)
            restored_t = resumed["t"] if resumed else None
            after = [w for w in progress if int(w.get("restart", 0)) == a + 1]
            done_before = max(
                (
                    int(w["last"]) + 1
                    for w in progress
                    if int(w.get("restart", 0)) == a and w["t"] <= t
                ),
                default=None,
            )
            lost = (
                max(0, done_before - int(resumed["step"]))
                if done_before is not None and resumed is not None
                else None
            )
            detect_t = min(detected) if detected else t
        else:
            restored_t = t
            # the window a retry happened in goes on; a rollback starts a new one
            after = [w for w in progress if int(w.get("restart", 0)) == a and w["t"] >= t]
            lost = _hot_lost(done, rank0, t, a)
            detect_t = min(detected) if detected else t
        # the first step completed after the recovery: a window's first step, or (in place,
        # where the window a retry came in goes on) rank 0's step.fingerprint, one per step
        ends = [float(w["t1_first"]) for w in after]
        if not cold:
            ends += [
                e["t"]
                for e in rank0
                if e.get("event") == ev.STEP_FINGERPRINT and int(e.get("restart", 0)) == a
            ]
        first_step = min((x for x in ends if x >= t), default=None)
        if joined is not None:
            label = "node joined"
        elif mine:
            label = str(chaos[mine[0]].get("kind", "?"))
        else:
            label = cause.kind if cause is not None else "unknown"
        out.append(
            FaultReport(
                attempt=a,
                kind=label,
                step=cause.step if cause is not None and cause.kind == "numeric" else None,
                fault_t=fault_t,
                exact_time=bool(mine) or joined is not None,
                detect_s=detect_t - fault_t,
                restart_s=(restored_t - fault_t) if restored_t is not None else None,
                recover_s=(first_step - fault_t) if first_step is not None else None,
                steps_lost=lost,
                recovery=kind,
                timeout=cause.timeout if cause is not None else None,
            )
        )
        # the next fault may come as soon as the first rank is done with this recovery, before
        # rank 0 says so (a rank that raised again at once: its fault is the next one's)
        same = str(done.get("event")) if done is not None else None
        prev_t = min(
            (
                e["t"]
                for e in events
                if e.get("event") == same and int(e.get("restart", 0)) == a and prev_t < e["t"] <= t
            ),
            default=t,
        )
    return out


def _hot_lost(
    done: dict[str, Any] | None, rank0: list[dict[str, Any]], t: float, attempt: int
) -> int | None:
    """Steps a hot recovery ran again: those completed before it, from the step it went back
    to (recovery.hot.formed says so itself; an OOM retry loses none)."""
    if done is None or done.get("event") == ev.OOM_RETRY:
        return 0
    if done.get("steps_lost") is not None:
        return int(done["steps_lost"])
    to = done.get("to_step")
    ran = [
        int(w["last"]) + 1
        for w in rank0
        if w.get("event") == ev.TRAIN_PROGRESS
        and int(w.get("restart", 0)) == attempt
        and w["t"] <= t
    ]
    if to is None or not ran:
        return None
    return max(0, max(ran) - int(to))
