"""Hang detection time with learned timeouts, and the recovery it starts (issue 50).

    python scripts/bench_detect.py     # 3 step times x 4 stalls hot, 1 cold per step time
    python scripts/bench_detect.py --step-s 0.1 --kinds collective --reps 3

A real 2-rank gloo job under `resilient run` (chaos/paced_train.py: DDP, each forward about
`--step-s`), with the default WatchdogConfig except a 10-step warm-up (20 by default), so a
1 s step's run stays short. One stall per run, injected by chaos.inject into rank 1 once the
learned timeouts are agreed (warm-up + 6 s of steps):

- collective: rank 1 sleeps in its forward; rank 0 waits for it in the gradient all-reduce
  (a live stall before a collective);
- gil: rank 1 busy-loops in Python in its forward (holds the GIL but for the interpreter's
  switch interval, in which the heartbeat thread runs);
- sigstop: rank 1 SIGSTOPs itself in its forward (its agent reads /proc);
- data: rank 1 sleeps in its data phase (fetching a batch);
- frozen: rank 1 sleeps in C holding the GIL in its forward: its heartbeats stop too, and
  its process stays in state S, so its agent sees nothing wrong. Rank 0 names it by the
  heartbeat timeout learned from the beats' gaps: the path of a process frozen on another
  host.

Per run, from the run's own events (resilient.report.analyze: the chaos record dates the
stall exactly): detection, stall -> the verdict (s, and as a multiple of the step time), the
timeout that fired, and the recovery's total, stall -> the first step every rank completes
after it. Hot: `--hot-recovery` (snapshots every step); cold: `--max-restarts 1`, a restart
from the newest checkpoint (every 10 steps; the steps it runs again are not in the total).
Medians over `--reps`. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resilient.report import analyze

REPO = Path(__file__).resolve().parent.parent
KINDS = {
    "collective": "hang@rank=1,step={s},phase=forward",
    "gil": "spin@rank=1,step={s},phase=forward",
    "sigstop": "stop@rank=1,step={s},phase=forward",
    "data": "hang@rank=1,step={s},phase=data",
    "frozen": "freeze@rank=1,step={s},phase=forward",
}
WARMUP = 10
WATCHDOG = {"learn_warmup_steps": WARMUP}


def one_run(out: Path, step_s: float, kind: str, *, hot: bool) -> dict[str, Any]:
    """One job with one stall; its detection and recovery figures."""
    stall = WARMUP + math.ceil(6.0 / step_s) + 5  # between two saves (every 10 steps)
    run = out / "run"
    argv = [sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node", "2"]
    argv += ["--run-dir", str(run), "--monitor-interval", "0.1"]
    argv += ["--hot-recovery"] if hot else ["--max-restarts", "1"]
    argv += ["-m", "chaos.inject", "--fault", KINDS[kind].format(s=stall), "--"]
    argv += [str(REPO / "chaos" / "paced_train.py"), "--step-s", str(step_s)]
    argv += ["--steps", str(stall + max(5, math.ceil(2.0 / step_s))), "--save-every", "10"]
    argv += ["--ckpt-dir", str(out / "ckpt"), "--run-dir", str(run)]
    env = {**os.environ, "RESILIENT_WATCHDOG": json.dumps(WATCHDOG), "PYTHONPATH": str(REPO)}
    if hot:
        env["RESILIENT_SNAPSHOT"] = json.dumps({"enabled": True, "every_steps": 1})
    limit = stall * step_s + 120
    with (out / "launcher.log").open("w") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    faults = analyze(run).faults if code == 0 else []
    if len(faults) != 1:
        tail = (out / "launcher.log").read_text()[-2000:]
        return {"ok": False, "exit": code, "faults": len(faults), "log": tail}
    f = faults[0]
    return {
        "ok": True,
        "recovery": f.recovery,
        "detect_s": f.detect_s,
        "detect_steps": f.detect_s / step_s if f.detect_s is not None else None,
        "timeout": f.timeout,
        "recover_s": f.recover_s,
        "after_detect_s": (
            f.recover_s - f.detect_s if f.recover_s is not None and f.detect_s is not None else None
        ),
    }


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get("ok") and r.get(key) is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-s", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    p.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    p.add_argument("--cold-kinds", nargs="*", choices=sorted(KINDS), default=["collective"])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="keep the runs here")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_detect-"))
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    plan = [(s, k, True) for s in args.step_s for k in args.kinds]
    plan += [(s, k, False) for s in args.step_s for k in args.cold_kinds]
    for step_s, kind, hot in plan:
        rows = []
        for rep in range(args.reps):
            out = root / f"{kind}-{step_s:g}-{'hot' if hot else 'cold'}-{rep}"
            out.mkdir(parents=True, exist_ok=True)
            rows.append(one_run(out, step_s, kind, hot=hot))
        row = {
            "step_s": step_s,
            "kind": kind,
            "path": "hot" if hot else "cold",
            "runs": len(rows),
            "failed": [r for r in rows if not r["ok"]],
            "detect_s": _median(rows, "detect_s"),
            "detect_steps": _median(rows, "detect_steps"),
            "recover_s": _median(rows, "recover_s"),
            "after_detect_s": _median(rows, "after_detect_s"),
            "timeout": next((r["timeout"] for r in rows if r.get("ok")), None),
            "recovery": next((r["recovery"] for r in rows if r.get("ok")), None),
        }
        results.append(row)
        print(
            f"step {step_s:>5g} s  {kind:<10} {row['path']:<4}  detect "
            f"{_fmt(row['detect_s'])} s ({_fmt(row['detect_steps'], 0)} steps)  "
            f"timeout {row['timeout']}  stall->next step {_fmt(row['recover_s'])} s "
            f"(verdict->next step {_fmt(row['after_detect_s'])} s)  "
            f"[{row['recovery']}; {len(row['failed'])} failed of {len(rows)}]",
            flush=True,
        )
    ratios: dict[str, dict[str, float]] = {"stall": {}, "verdict": {}}
    for step_s in args.step_s:
        for key, name in (("recover_s", "stall"), ("after_detect_s", "verdict")):
            mine = [r for r in results if r["step_s"] == step_s and r["kind"] in args.cold_kinds]
            cold_s = [r[key] for r in mine if r["path"] == "cold" and r[key]]
            hot_s = [r[key] for r in mine if r["path"] == "hot" and r[key]]
            if cold_s and hot_s:
                ratios[name][f"{step_s:g}"] = round(hot_s[0] / cold_s[0], 3)
    print(
        f"hot / cold to the next step, from the stall: {ratios['stall']}; from the verdict: "
        f"{ratios['verdict']}  ({time.monotonic() - t0:.0f} s in all)"
    )
    print(json.dumps({"results": results, "hot_over_cold": ratios}, default=str))


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    main()
