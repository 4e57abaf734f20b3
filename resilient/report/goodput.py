"""`analyze`: goodput and the effective save cost of a run, from its logs, with its recoveries
and the Young/Daly optimum (optimum.py) to compare with.

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

`analyze_events` is the same analysis of events already read: the live metrics
(resilient/live/) compute the run's goodput so far with it, every few seconds, so its work
per window is a bisection, never a scan of every window or save.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient import events as ev
from resilient.hang.learned import table_of
from resilient.report.logs import _number_attempts_across_launches, load_events
from resilient.report.optimum import young_daly
from resilient.report.recovery import recoveries
from resilient.report.results import MEMBERSHIP, RunReport

__all__ = ["analyze", "analyze_events", "prepare_events"]

_NEAR_S = 10.0
"""Clean windows of the same attempt within this many seconds are a save window's reference."""


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


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


def _suffix_min(xs: list[int]) -> list[float]:
    """out[i] = min(xs[i:]), and inf past the end."""
    out: list[float] = [math.inf] * (len(xs) + 1)
    for i in range(len(xs) - 1, -1, -1):
        out[i] = min(out[i + 1], xs[i])
    return out


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


def numeric_faults(rank0: list[dict[str, Any]]) -> dict[str, Any]:
    """The numerical faults, skipped steps and suspect ranks of a run, from rank 0's log."""
    faults = [e for e in rank0 if e.get("event") == "numeric.fault"]
    skipped = sorted({int(e["step"]) for e in rank0 if e.get("event") == "numeric.skip"})
    ranges: list[tuple[int, int]] = []
    for st in skipped:
        if ranges and ranges[-1][1] == st - 1:
            ranges[-1] = (ranges[-1][0], st)
        else:
            ranges.append((st, st))
    strikes: dict[int, int] = {}
    for e in rank0:
        if e.get("event") == "numeric.transient":
            for r in e.get("ranks", []):
                strikes[int(r)] = strikes.get(int(r), 0) + 1
    return {"numeric": faults, "skipped": ranges, "suspects": strikes}


def analyze(
    run_dir: str | Path, *, mtbf_s: float | None = None, save_cost_s: float | None = None
) -> RunReport:
    """Build the report from the logs. `mtbf_s` overrides the MTBF measured from the faults;
    `save_cost_s` stands in for the effective save cost when this run cannot measure it (no
    window without a save to compare with: an interval shorter than about two seconds)."""
    events = load_events(run_dir)
    if not events:
        raise FileNotFoundError(f"no events under {Path(run_dir, 'logs')}")
    return analyze_events(events, mtbf_s=mtbf_s, save_cost_s=save_cost_s)


def prepare_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events read some other way, made what `load_events` returns: copies (the originals
    are not changed), each with its float `t` already set, in time order, attempts numbered
    across launches."""
    out = sorted((dict(e) for e in events if "t" in e), key=lambda e: e["t"])
    _number_attempts_across_launches(out)
    return out


def analyze_events(
    events: list[dict[str, Any]], *, mtbf_s: float | None = None, save_cost_s: float | None = None
) -> RunReport:
    """`analyze` of events as `load_events` (or `prepare_events`) returns them; ValueError
    when there are none."""
    if not events:
        raise ValueError("no events")
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
    # (suffix minima over attempts and over window starts: one bisection per window)
    resumed = sorted((a, int(r["step"])) for a, r in resumes.items())
    resumed_after = _suffix_min([s for _, s in resumed])
    by_t0 = sorted(windows, key=lambda o: o.t0)
    t0s = [o.t0 for o in by_t0]
    first_after = _suffix_min([o.first for o in by_t0])

    def cut(w: _Window) -> float:
        later = resumed_after[bisect.bisect_right(resumed, (w.attempt, math.inf))]
        return min(later, first_after[bisect.bisect_right(t0s, w.t0)])

    # saves, as intervals of rank 0's time: start to commit (a save cut short: its start)
    starts = [e for e in rank0 if e.get("event") == "ckpt.save.start"]
    committed = [e for e in rank0 if e.get("event") == "ckpt.save.committed"]
    done_at = {(int(e.get("restart", 0)), int(e["step"])): e["t"] for e in committed}
    saves = [
        (e["t"], done_at.get((int(e.get("restart", 0)), int(e["step"])), e["t"])) for e in starts
    ]

    # saves by start: one that ends at or after t began at most `longest` (+1 s) before it
    by_start = sorted(range(len(saves)), key=lambda i: saves[i][0])
    starts_at = [saves[i][0] for i in by_start]
    longest = max([0.0] + [b - a for a, b in saves]) + 1.0

    def overlaps(w: _Window) -> list[int]:
        lo = bisect.bisect_left(starts_at, w.t0 - longest)
        hi = bisect.bisect_right(starts_at, w.t0 + w.span)
        return sorted(i for i in by_start[lo:hi] if saves[i][1] >= w.t0)

    # reference step from windows that overlap no save (an attempt's first step, alone in its
    # window and slower, is left out): for each save window the median of the clean windows
    # of its attempt within _NEAR_S, since the load of a shared machine moves step times far
    # more than a save does; a save window with none near is left as it is
    first_of: dict[int, int] = {}
    for w in windows:
        first_of[w.attempt] = min(first_of.get(w.attempt, w.first), w.first)
    firsts = {first_of.get(a, -1) for a in attempts}
    clean = [w for w in windows if not overlaps(w) and not (w.first in firsts and w.n == 1)]
    gap = _median([(w.span - w.busy) / w.gaps for w in clean if w.gaps > 0])
    clean_by_t0 = sorted(clean, key=lambda c: c.t0)
    clean_t0s = [c.t0 for c in clean_by_t0]

    def reference(w: _Window) -> tuple[float, float] | None:
        lo = bisect.bisect_left(clean_t0s, w.t0 - _NEAR_S - 1.0)
        hi = bisect.bisect_right(clean_t0s, w.t0 + _NEAR_S + 1.0)
        near = [
            c for c in clean_by_t0[lo:hi] if c.attempt == w.attempt and abs(c.t0 - w.t0) <= _NEAR_S
        ]
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

    joins = [e["t"] for e in events if e.get("event") == "restart.membership"]
    found = recoveries(events, rank0, inits, resumes, progress, attempts, chaos, start, joins)
    faults = [f for f in found if f.recovery != MEMBERSHIP]
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
        membership=[f for f in found if f.recovery == MEMBERSHIP],
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
        **numeric_faults(rank0),
    )
    learned = [e for e in rank0 if e.get("event") == ev.HANG_TIMEOUTS]
    if learned:
        report.hang_timeouts = table_of(learned[-1])
        report.hang_pinned = list(learned[-1].get("pinned") or [])
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
