"""What a run's event logs say about it: goodput, faults, recovery, and the optimum to aim at.

Reads only `<run_dir>/logs/*.jsonl`. The events it uses:
- `runtime.init` / `runtime.resume` (per attempt), `train.progress` (step windows with busy
  seconds), `ckpt.save.staged` / `ckpt.save.committed` (save cost), and detection events
  (`hang.detected`, `fault.detected`, `watchdog.exit`, `guard.failure`).
- `chaos.fault` lines that the chaos harness writes to `logs/chaos.jsonl` give exact fault
  times; without them a fault's time is estimated as the last event of the failed attempt.

Goodput = time spent in steps that count towards the final state / wall time. Steps that a
later attempt replays do not count; neither do start-up, saves, detection and restarts.
The Young/Daly optimum: with checkpoint cost C, restart cost R and mean time between failures
M, the best interval is about sqrt(2 C M) and the best goodput about
1 - C/tau - (tau/2 + R)/M (first order; Daly 2006).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["FaultReport", "RunReport", "analyze", "format_report", "plot_timeline"]

_DETECTION = ("hang.detected", "fault.detected", "watchdog.exit", "guard.failure")


def _ts(e: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(e["ts"]).replace("Z", "+00:00")).timestamp()


def load_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of the run, each with a float `t` (epoch seconds), in time order."""
    out = []
    for path in sorted(Path(run_dir, "logs").glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
                e["t"] = _ts(e)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            out.append(e)
    return sorted(out, key=lambda e: e["t"])


@dataclass(slots=True)
class FaultReport:
    attempt: int
    """The attempt (restart count) that the fault ended."""
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
    """Steps completed before the fault that the new attempt had to replay (a lower bound
    when the failed attempt's last progress event was lost with it)."""


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

    @property
    def goodput_over_optimum(self) -> float | None:
        if not self.optimal_goodput:
            return None
        return self.goodput / self.optimal_goodput


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def analyze(run_dir: str | Path, *, mtbf_s: float | None = None) -> RunReport:
    """Build the report from the logs. `mtbf_s` overrides the MTBF measured from the faults."""
    events = load_events(run_dir)
    if not events:
        raise FileNotFoundError(f"no events under {Path(run_dir, 'logs')}")
    rank0 = [e for e in events if e.get("rank") == 0]
    progress = [e for e in rank0 if e.get("event") == "train.progress"]
    inits = [e for e in rank0 if e.get("event") == "runtime.init"]
    resumes = {int(e["restart"]): e for e in rank0 if e.get("event") == "runtime.resume"}
    attempts = sorted({int(e.get("restart", 0)) for e in inits}) or [0]
    start = min(e["t"] for e in events)
    end = max(e["t"] for e in events)

    # steps that survive: an attempt's steps at or beyond the next attempt's resume point
    # were replayed, so only [first, next_resume) of each attempt counts
    productive = 0.0
    for w in progress:
        a = int(w.get("restart", 0))
        nxt = resumes.get(a + 1)
        cut = int(nxt["step"]) if nxt is not None else math.inf
        n = int(w["last"]) - int(w["first"]) + 1
        kept = max(0, min(int(w["last"]), cut - 1) - int(w["first"]) + 1)
        productive += float(w["busy_s"]) * kept / n
    step_times = [float(w["busy_s"]) / (int(w["last"]) - int(w["first"]) + 1) for w in progress]

    staged = [float(e["blocked_s"]) for e in rank0 if e.get("event") == "ckpt.save.staged"]
    sync = [
        float(e["seconds"])
        for e in rank0
        if e.get("event") == "ckpt.save.committed" and e.get("mode") == "sync"
    ]
    committed = [e for e in rank0 if e.get("event") == "ckpt.save.committed"]
    save_cost = _median(staged + sync)
    chaos = [e for e in events if e.get("event") == "chaos.fault"]

    faults = []
    for a in attempts[:-1]:
        nxt_init = next((e for e in inits if int(e["restart"]) == a + 1), None)
        if nxt_init is None:
            continue
        in_attempt = [e for e in events if int(e.get("restart", -1)) == a]
        t_end = max((e["t"] for e in in_attempt), default=nxt_init["t"])
        attempt_start = next((e["t"] for e in inits if int(e["restart"]) == a), start)
        injected = [c for c in chaos if attempt_start <= c["t"] <= nxt_init["t"]]
        fault_t = injected[0]["t"] if injected else t_end
        kind = str(injected[0].get("kind", "?")) if injected else "unknown"
        detected = [
            e["t"] for e in in_attempt if e.get("event") in _DETECTION and e["t"] >= fault_t - 0.001
        ]
        detect_t = min(detected) if detected else nxt_init["t"]
        resumed = resumes.get(a + 1)
        first_step = next((w for w in progress if int(w.get("restart", 0)) == a + 1), None)
        done_before = max(
            (int(w["last"]) + 1 for w in progress if int(w.get("restart", 0)) == a), default=None
        )
        lost = None
        if done_before is not None and resumed is not None:
            lost = max(0, done_before - int(resumed["step"]))
        faults.append(
            FaultReport(
                attempt=a,
                kind=kind,
                fault_t=fault_t,
                exact_time=bool(injected),
                detect_s=detect_t - fault_t,
                restart_s=resumed["t"] - fault_t if resumed else None,
                recover_s=(float(first_step["t1_first"]) - fault_t) if first_step else None,
                steps_lost=lost,
            )
        )

    wall = end - start
    report = RunReport(
        wall_s=wall,
        productive_s=productive,
        goodput=productive / wall if wall > 0 else 0.0,
        final_step=max((int(w["last"]) + 1 for w in progress), default=0),
        attempts=len(attempts),
        step_s=_median(step_times),
        save_cost_s=save_cost,
        saves=len(committed),
        faults=faults,
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
        c, m, r = save_cost, report.mtbf_s, report.restart_cost_s or 0.0
        tau = math.sqrt(2 * c * m)  # Young
        if c < 2 * m:  # Daly's higher-order correction
            x = c / (2 * m)
            tau = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
        report.optimal_interval_s = tau
        report.optimal_goodput = max(0.0, 1 - c / tau - (tau / 2 + r) / m) if tau > 0 else None
    return report


def format_report(rep: RunReport) -> str:
    def s(x: float | None, unit: str = " s", digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}{unit}"

    lines = [
        f"wall time            {s(rep.wall_s)}",
        f"productive step time {s(rep.productive_s)}",
        f"goodput              {rep.goodput:.3f}",
        f"final step           {rep.final_step}  ({rep.attempts} attempt(s), {rep.saves} saves)",
        f"median step          {s(rep.step_s, ' s', 4)}",
        f"save cost (blocked)  {s(rep.save_cost_s, ' s', 4)}  "
        f"(measured interval {s(rep.interval_s)})",
    ]
    if rep.faults:
        lines += ["", "fault  kind              detect    restart    recover  steps lost"]
        for i, f in enumerate(rep.faults):
            lost = "-" if f.steps_lost is None else str(f.steps_lost)
            note = "" if f.exact_time else "  (fault time estimated from the logs)"
            lines.append(
                f"{i:>5}  {f.kind:<16} {s(f.detect_s):>8} {s(f.restart_s):>10} "
                f"{s(f.recover_s):>10}  {lost:>10}{note}"
            )
    if rep.optimal_goodput is not None:
        ratio = rep.goodput_over_optimum
        lines += [
            "",
            f"Young/Daly: MTBF {s(rep.mtbf_s)}, save cost {s(rep.save_cost_s, ' s', 4)}, "
            f"restart cost {s(rep.restart_cost_s)}",
            f"  optimal interval {s(rep.optimal_interval_s)}, optimal goodput "
            f"{rep.optimal_goodput:.3f}, measured/optimum "
            + ("-" if ratio is None else f"{ratio:.3f}"),
        ]
    return "\n".join(lines)


def plot_timeline(run_dir: str | Path, out_png: str | Path) -> Path:
    """Draw steps, saves, faults and restarts per rank over time into a PNG."""
    import matplotlib  # optional dependency: the "report" extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load_events(run_dir)
    t0 = min(e["t"] for e in events)
    ranks = sorted({int(e["rank"]) for e in events if "rank" in e})
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(ranks)))
    for e in events:
        r = int(e.get("rank", -1))
        if e.get("event") == "train.progress":
            ax.broken_barh(
                [(float(e["t0"]) - t0, float(e["t1"]) - float(e["t0"]))],
                (r - 0.3, 0.6),
                color="tab:green",
            )
        elif e.get("event") == "ckpt.save.committed":
            ax.broken_barh(
                [(e["t"] - t0 - float(e["seconds"]), float(e["seconds"]))],
                (r - 0.45, 0.15),
                color="tab:blue",
            )
        elif e.get("event") == "runtime.init" and int(e.get("restart", 0)) > 0:
            ax.axvline(e["t"] - t0, color="grey", linestyle="--", linewidth=0.8)
        elif e.get("event") in _DETECTION:
            ax.plot(e["t"] - t0, r, marker="v", color="tab:orange")
        elif e.get("event") == "chaos.fault":
            ax.plot(
                e["t"] - t0,
                int(e.get("target_rank", 0)),
                marker="X",
                color="tab:red",
                markersize=10,
            )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds since start")
    ax.set_title(
        "steps (green), saves (blue), faults (red X), detections (orange), restarts (dashed)",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
