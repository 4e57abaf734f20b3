"""What a run's event logs say about it: goodput, faults, recovery, and the optimum to aim at.

Reads only `<run_dir>/logs/*.jsonl`. The events it uses:
- `runtime.init` / `runtime.resume` (per attempt), `train.progress` (step windows with busy
  seconds), `ckpt.save.start` / `ckpt.save.staged` / `ckpt.save.committed` (save cost), and
  detection events (`hang.detected`, `fault.detected`, `watchdog.exit`, `guard.failure`, the
  supervisor's `worker.failed`).
- `chaos.fault` lines that the chaos harness writes to `logs/chaos.jsonl` give exact fault
  times; without them a fault's time is estimated as the last event of the failed attempt.

Goodput = time spent in step bodies that count towards the final state / wall time. A step
counts only if every later attempt resumed after it. Replayed steps, start-up, saves,
detection, restarts and the time between step bodies (the runtime's per-step work) do not.

Save cost. An async save blocks the loop only while it stages (`blocked_s`), but the loop
also waits in the optimizer fence and its steps run slower while the write goes on beside
them. The effective cost is measured from the loop itself: `train.progress` windows of the
same attempt that overlap no save, within _NEAR_S seconds, give the reference time per step
(step body, and time between bodies); the excess of a window that overlaps a save, over that
reference, is what the save cost. That excess is not productive time, and C = excess / saves,
never below the blocked time. Without a clean window near any save (an interval of about two
progress windows or less), C is `analyze(save_cost_s=...)` if given (a calibration run's),
else the blocked time (`save_cost_basis` says which).

The Young/Daly optimum: with checkpoint cost C, restart cost R (fault to the resumed state)
and mean time between failures M, the best interval is about sqrt(2 C M) (Daly's higher-order
form is used) and the best goodput about 1 - C/tau - (tau/2 + R)/M (first order; Daly 2006).
That is a steady state: it has no one-time start-up before step 0 and no final save and exit,
which every run pays once whatever its interval. `optimal_run_goodput` adds this run's own
start-up and end to the optimum (the same productive work P takes P / optimum + start-up + end)
and `goodput_over_optimum` compares the measured goodput with it; `steady_goodput` leaves
start-up and end out of the measured wall time instead (the two ratios are close).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient import events as ev

__all__ = [
    "COLD",
    "HOT_REPLACEMENT",
    "HOT_ROLLBACK",
    "RETRY",
    "FaultReport",
    "RunReport",
    "analyze",
    "load_events",
    "young_daly",
]

_NEAR_S = 10.0
"""Clean windows of the same attempt within this many seconds are a save window's reference."""
_DETECTION = ev.DETECTION


def load_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of the run, each with a float `t` (epoch seconds), in time order."""
    out = []
    for e in ev.iter_events(Path(run_dir, "logs")):
        try:
            e["t"] = ev.timestamp(e)
        except (ValueError, KeyError, TypeError):
            continue  # no time: not ours
        out.append(e)
    out.sort(key=lambda e: e["t"])
    _number_attempts_across_launches(out)
    return out


def _number_attempts_across_launches(events: list[dict[str, Any]]) -> None:
    """Make `restart` count attempts over the whole run, in place.

    Within one launch `restart` is torch elastic's restart count. A preemption ends the
    launch, and the next launch (the same command again) counts from 0: its attempts would
    merge with the first launch's. A rank process's launch is known from its own
    `runtime.init` (restart 0 starts a new launch for that rank), the supervisor's from its
    pid; each launch is then offset by the attempts of the launches before it."""
    rank_launch: dict[tuple[Any, Any], int] = {}
    launches_of_rank: dict[Any, int] = {}
    sup_launch: dict[Any, int] = {}
    most: dict[int, int] = {}  # launch -> highest restart seen in it
    for e in events:
        if e.get("event") == "runtime.init" and e.get("rank") is not None:
            key = (e["rank"], e.get("pid"))
            if key in rank_launch:
                continue
            n = launches_of_rank.get(e["rank"], -1)
            if int(e.get("generation") or 0) > 0 and n >= 0:
                # a hot replacement: a new process in the same attempt, not a relaunch
                rank_launch[key] = n
                continue
            if int(e.get("restart", 0)) == 0 or n < 0:
                n += 1
            launches_of_rank[e["rank"]] = n
            rank_launch[key] = n
            most[n] = max(most.get(n, 0), int(e.get("restart", 0)))
        elif e.get("event") == "supervisor.start" and e.get("pid") not in sup_launch:
            sup_launch[e.get("pid")] = len(sup_launch)
    if len(most) < 2:
        return  # one launch: restart already counts every attempt
    offset: dict[int, int] = {}
    acc = 0
    for n in sorted(most):
        offset[n] = acc
        acc += most[n] + 1
    for e in events:
        if "restart" not in e:
            continue
        launch: int | None
        if e.get("rank") is not None:
            launch = rank_launch.get((e["rank"], e.get("pid")))
        elif e.get("source") == "supervisor":
            launch = sup_launch.get(e.get("pid"))
        else:
            launch = None
        if launch is not None and launch in offset:
            e["launch"] = launch
            e["restart"] = offset[launch] + int(e["restart"])


HOT_ROLLBACK = "hot rollback"
"""Every rank rolled back in place to an in-memory snapshot; no process lost."""
HOT_REPLACEMENT = "hot replacement"
"""A lost process was replaced warm; the survivors re-formed their groups."""
RETRY = "oom retry"
"""The OOM guard retried the batch in smaller micro-batches, in place."""
COLD = "cold restart"
"""The group was restarted: fresh processes, the newest checkpoint."""


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
    """COLD, HOT_ROLLBACK, HOT_REPLACEMENT or RETRY."""


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


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


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


@dataclass(slots=True)
class _Window:
    """One rank-0 `train.progress` event: steps first..last of one attempt."""

    attempt: int
    first: int
    last: int
    t0: float
    t1: float
    busy: float
    span: float = 0.0
    """t0 to the next contiguous window's t0 (n steps and n gaps), else t0 to t1."""
    gaps: int = 0

    @property
    def n(self) -> int:
        return self.last - self.first + 1


def _windows(progress: list[dict[str, Any]]) -> list[_Window]:
    ws = sorted(
        (
            _Window(
                attempt=int(w.get("restart", 0)),
                first=int(w["first"]),
                last=int(w["last"]),
                t0=float(w["t0"]),
                t1=float(w["t1"]),
                busy=float(w["busy_s"]),
            )
            for w in progress
        ),
        key=lambda w: (w.attempt, w.t0),
    )
    for w, nxt in itertools.zip_longest(ws, ws[1:]):
        if nxt is not None and nxt.attempt == w.attempt and nxt.first == w.last + 1:
            w.span, w.gaps = nxt.t0 - w.t0, w.n
        else:
            w.span, w.gaps = w.t1 - w.t0, w.n - 1
    return ws


def analyze(
    run_dir: str | Path, *, mtbf_s: float | None = None, save_cost_s: float | None = None
) -> RunReport:
    """Build the report from the logs. `mtbf_s` overrides the MTBF measured from the faults;
    `save_cost_s` stands in for the effective save cost when this run cannot measure it (no
    window without a save to compare with: an interval shorter than about two seconds)."""
    events = load_events(run_dir)
    if not events:
        raise FileNotFoundError(f"no events under {Path(run_dir, 'logs')}")
    rank0 = [e for e in events if e.get("rank") == 0]
    progress = [e for e in rank0 if e.get("event") == "train.progress"]
    inits = [e for e in rank0 if e.get("event") == "runtime.init"]
    # each attempt's own resume; a hot recovery later in the attempt resumes again
    resumes: dict[int, dict[str, Any]] = {}
    for e in rank0:
        if e.get("event") == "runtime.resume" and not e.get("hot"):
            resumes.setdefault(int(e["restart"]), e)
    attempts = sorted({int(e.get("restart", 0)) for e in inits}) or [0]
    start = min(e["t"] for e in events)
    end = max(e["t"] for e in events)
    windows = _windows(progress)

    # A step survives when nothing later ran it again: no later attempt resumed at or before
    # it (one that died before resuming has no resume), and no later window of steps started
    # at or before it (a rollback in place, or a hot re-formation, replays within the attempt).
    def cut(w: _Window) -> float:
        later = [int(r["step"]) for a, r in resumes.items() if a > w.attempt]
        later += [o.first for o in windows if o.t0 > w.t0]
        return min(later, default=math.inf)

    # saves, as intervals of rank 0's time: start to commit (a save cut short: its start)
    starts = [e for e in rank0 if e.get("event") == "ckpt.save.start"]
    committed = [e for e in rank0 if e.get("event") == "ckpt.save.committed"]
    done_at = {(int(e.get("restart", 0)), int(e["step"])): e["t"] for e in committed}
    saves = [
        (e["t"], done_at.get((int(e.get("restart", 0)), int(e["step"])), e["t"])) for e in starts
    ]

    def overlaps(w: _Window) -> list[int]:
        return [i for i, (a, b) in enumerate(saves) if a <= w.t0 + w.span and b >= w.t0]

    # reference step from windows that overlap no save (an attempt's first step, alone in its
    # window and slower, is left out): for each save window the median of the clean windows
    # of its attempt within _NEAR_S, since the load of a shared machine moves step times far
    # more than a save does; a save window with none near is left as it is
    firsts = {min((w.first for w in windows if w.attempt == a), default=-1) for a in attempts}
    clean = [w for w in windows if not overlaps(w) and not (w.first in firsts and w.n == 1)]
    gap = _median([(w.span - w.busy) / w.gaps for w in clean if w.gaps > 0])

    def reference(w: _Window) -> tuple[float, float] | None:
        near = [c for c in clean if c.attempt == w.attempt and abs(c.t0 - w.t0) <= _NEAR_S]
        b = _median([c.busy / c.n for c in near])
        g = _median([(c.span - c.busy) / c.gaps for c in near if c.gaps > 0])
        return None if b is None or g is None else (b, g)

    busy_kept = replayed = extra_busy = extra_busy_kept = extra_gap = 0.0
    hit: set[int] = set()
    for w in windows:
        kept = max(0, min(w.last, cut(w) - 1) - w.first + 1)
        busy_kept += w.busy * kept / w.n
        replayed += w.busy * (w.n - kept) / w.n
        over = overlaps(w)
        ref = reference(w) if over else None
        if ref is not None:
            hit.update(over)
            extra_busy += w.busy - w.n * ref[0]
            extra_busy_kept += (w.busy - w.n * ref[0]) * kept / w.n
            extra_gap += (w.span - w.busy) - w.gaps * ref[1]
    # noise can make the sums negative: a save never makes steps faster, so they clip at 0,
    # and productive time never exceeds the measured step time
    slowdown = max(0.0, extra_busy + extra_gap)
    productive = busy_kept - min(max(0.0, extra_busy_kept), slowdown)
    step_times = [w.busy / w.n for w in windows]

    staged = [float(e["blocked_s"]) for e in rank0 if e.get("event") == "ckpt.save.staged"]
    sync = [
        float(e["seconds"])
        for e in rank0
        if e.get("event") == "ckpt.save.committed" and e.get("mode") == "sync"
    ]
    blocked = _median(staged + sync)
    save_cost: float | None = blocked
    basis = "blocked"
    if hit:
        # the blocked time lies inside the measured excess, so it is a floor against noise
        save_cost, basis = max(slowdown / len(hit), blocked or 0.0), "effective"
    elif save_cost_s is not None:
        save_cost, basis = save_cost_s, "given"
    chaos = [e for e in events if e.get("event") == "chaos.fault"]

    faults = _recoveries(events, rank0, inits, resumes, progress, attempts, chaos, start)
    wall = end - start
    # one-time start-up: to the first step, or to the first fault if one came before it (the
    # rest is that fault's restart)
    first_t0 = min([w.t0 for w in windows] + [f.fault_t for f in faults], default=None)
    last_t1 = max((w.t1 for w in windows), default=None)
    report = RunReport(
        wall_s=wall,
        productive_s=productive,
        goodput=productive / wall if wall > 0 else 0.0,
        final_step=max((w.last + 1 for w in windows), default=0),
        attempts=len(attempts),
        step_s=_median(step_times),
        save_cost_s=save_cost,
        saves=len(committed),
        faults=faults,
        blocked_s=blocked,
        save_cost_basis=basis,
        save_slowdown_s=slowdown,
        step_overhead_s=gap,
        startup_s=(first_t0 - start) if first_t0 is not None else wall,
        end_s=(end - last_t1) if last_t1 is not None else 0.0,
        replayed_s=replayed,
        replay_verified=[
            (int(e.get("rank", -1)), int(e.get("steps", 0)))
            for e in events
            if e.get("event") == ev.RESUME_VERIFIED
        ],
        replay_diverged=[e for e in events if e.get("event") == ev.RESUME_DIVERGED],
    )
    if len(committed) >= 2:
        gaps = [
            b["t"] - a_["t"]
            for a_, b in itertools.pairwise(committed)
            if int(b.get("restart", 0)) == int(a_.get("restart", 0))
        ]
        report.interval_s = _median(gaps)
    report.mtbf_s = mtbf_s or (wall / len(faults) if faults else None)
    restarts = [f.restart_s for f in faults if f.restart_s is not None]
    report.restart_cost_s = _median(restarts)
    if report.mtbf_s and save_cost:
        tau, best = young_daly(save_cost, report.restart_cost_s or 0.0, report.mtbf_s)
        report.optimal_interval_s = tau
        report.optimal_goodput = best
        if best > 0:
            one_time = report.startup_s + report.end_s
            report.optimal_run_goodput = productive / (productive / best + one_time)
    return report


_HOT_DONE = {
    ev.ROLLBACK_DONE: HOT_ROLLBACK,
    ev.RECOVERY_HOT_FORMED: HOT_REPLACEMENT,
    ev.OOM_RETRY: RETRY,
}
_DETECT = set(_DETECTION) | {
    ev.ROLLBACK_AGREED,
    ev.ROLLBACK_REFUSED,
    ev.RECOVERY_HOT_DETECT,
    ev.RECOVERY_COLD,
    ev.OOM_RETRY,
}


def _recoveries(
    events: list[dict[str, Any]],
    rank0: list[dict[str, Any]],
    inits: list[dict[str, Any]],
    resumes: dict[int, dict[str, Any]],
    progress: list[dict[str, Any]],
    attempts: list[int],
    chaos: list[dict[str, Any]],
    start: float,
) -> list[FaultReport]:
    """Every recovery of the run in time order: cold restarts (a new attempt) and hot ones
    (rank 0's rollback.done, recovery.hot.formed or oom.retry), each labelled by its own
    fault: the first chaos.fault since the recovery before it (without one, the fault time
    is estimated from the logs)."""
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
        mine = [i for i, c in enumerate(chaos) if i not in used and prev_t - 0.001 <= c["t"] <= t]
        if mine:
            used.add(mine[0])
        if kind == COLD:
            in_attempt = [e["t"] for e in events if int(e.get("restart", -1)) == a and e["t"] <= t]
            est = max(in_attempt, default=t)
        else:  # the agreement that named it, or the retry itself
            est = next(
                (e["t"] for e in rank0 if prev_t <= e["t"] <= t and e.get("event") in _DETECT),
                t,
            )
        fault_t = chaos[mine[0]]["t"] if mine else est
        detected = [
            e["t"] for e in events if e.get("event") in _DETECT and fault_t - 0.001 <= e["t"] <= t
        ]
        if kind == COLD:
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
        if kind != COLD:
            ends += [
                e["t"]
                for e in rank0
                if e.get("event") == ev.STEP_FINGERPRINT and int(e.get("restart", 0)) == a
            ]
        first_step = min((x for x in ends if x >= t), default=None)
        out.append(
            FaultReport(
                attempt=a,
                kind=str(chaos[mine[0]].get("kind", "?")) if mine else "unknown",
                fault_t=fault_t,
                exact_time=bool(mine),
                detect_s=detect_t - fault_t,
                restart_s=(restored_t - fault_t) if restored_t is not None else None,
                recover_s=(first_step - fault_t) if first_step is not None else None,
                steps_lost=lost,
                recovery=kind,
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
