"""Goodput under random kill -9 faults against the Young/Daly optimum for the same costs.

    python scripts/bench_goodput.py            # MTBF 45 s, 3 runs of about 4 minutes each
    python scripts/bench_goodput.py --quick    # MTBF 20 s, 1 run of about a minute
    python scripts/bench_goodput.py --hot      # the same under resilient run --hot-recovery

The recipe recipes/train_ddp.py (a small GPT, DDP on 2 ranks, async saves) runs under the
product's own launcher, `resilient run`: what a user launches with, so its restart path
(detection, torch elastic's rendezvous, respawn) is what is measured. The crash-loop limit is
raised so that two faults close together cannot stop the run; its backoff stays as shipped.

1. Calibration: a fault-free run with a save every few seconds and then one kill -9. From its
   report: the reference step time, the effective save cost C (blocked time plus the slowdown
   of the steps beside the background write, from step times; resilient/report/goodput.py) and the
   restart cost R (fault to the resumed state).
2. The checkpoint interval is set to Daly's optimum for C and the MTBF M, in steps
   (`--save-every`, the recipe has no time-based flag).
3. Each measured run: kill -9 of a random rank at seeded exponential inter-arrival times
   (mean M), each drawn when the previous fault is injected, and written to
   <run_dir>/logs/chaos.jsonl as the chaos harness writes it. A fault that comes due while the
   group is restarting waits until the new attempt has resumed: first-order Young/Daly has no
   faults inside a restart either (the expected shift is about R^2 / 2M, 0.3 s at M = 45 s).
   Then `resilient.report.analyze(run_dir, mtbf_s=M)`: the measured goodput against the
   optimum computed from that run's own C and R, with the run's one-time start-up and end
   added to the optimum (see resilient/report/optimum.py).

With `--hot` the launcher runs with `--hot-recovery` and the recipe steps through
`rt.micro_batches`: a killed rank is replaced by a warm spare while the other stays alive and
both continue from the newest in-memory snapshot, so the restart cost R that the optimum is
computed with is the hot one (fault to the resumed generation).

Each run is also compared with the optimum for the faults it actually had (MTBF = wall time
/ faults): over a run of a few minutes the number of faults is Poisson with a mean of a few,
so against the scenario's MTBF a run with few faults beats the "optimum" and one with many
falls far short of it. And since the time between step bodies (the runtime's per-step
preemption agreement, plus the wait for the slower rank that DDP's all-reduce would absorb
without it) is not productive, a bound with that time counted as productive is printed too.

The last line of output is one JSON object with the medians (`median`), the recovery phases
(`recovery_phases`, median seconds over all faults) and every run's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.procs import Run, alive, events  # noqa: E402
from resilient.report import analyze, format_report, load_events, young_daly  # noqa: E402

RECIPE = REPO / "recipes" / "train_ddp.py"


def _record(run_dir: Path, **fields: Any) -> None:
    """A chaos.fault event, written exactly as chaos/external.py's `_record` writes it."""
    ts = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    with (run_dir / "logs" / "chaos.jsonl").open("a") as f:
        f.write(json.dumps({"event": "chaos.fault", "ts": ts, **fields}) + "\n")


def _cmd(out: Path, steps: int, save_every: int, seed: int, hot: bool) -> list[str]:
    run_dir = out / "run"
    # hot: a lost rank is replaced by a warm spare while the survivor stays alive; the survivor
    # notices the loss in rt.micro_batches' collectives, so the recipe steps through them
    hot_launch = ["--hot-recovery", "--hot-max=1000"] if hot else []
    hot_recipe = ["--micro-batches"] if hot else []
    return [
        sys.executable, "-m", "resilient.cli", "run",
        "--nproc-per-node=2",
        "--max-restarts=1000",
        "--crash-loop-restarts=1000",
        f"--run-dir={run_dir}",
        *hot_launch,
        str(RECIPE),
        *hot_recipe,
        "--steps", str(steps),
        "--save-every", str(save_every),
        "--log-every", "1000000",
        "--seed", str(seed),
        "--batch-size", "8",
        "--workers", "0",
        "--ckpt-dir", str(out / "ckpt"),
        "--run-dir", str(run_dir),
    ]  # fmt: skip


Epoch = tuple[int, int]
"""(attempt, hot-recovery generation): a cold restart starts a new attempt at generation 0, a
hot recovery a new generation of the same attempt."""


def _victim(run_dir: Path, rank: int, after: Epoch) -> tuple[Epoch, int] | None:
    """(epoch, PID) of `rank` in the newest attempt and generation, if that is newer than
    `after`, has resumed (is training) and the process is up."""
    evs = list(events(run_dir, rank))
    inits = [e for e in evs if e.get("event") == "runtime.init" and e.get("rank") == rank]
    if not inits:
        return None
    newest = max(inits, key=lambda e: (int(e.get("restart", 0)), int(e.get("generation") or 0)))
    epoch = (int(newest.get("restart", 0)), int(newest.get("generation") or 0))
    pid = int(newest["pid"])
    resumed = any(
        e.get("event") == "runtime.resume"
        and int(e.get("pid", -1)) == pid
        and e["ts"] >= newest["ts"]
        for e in evs
    )
    return (epoch, pid) if epoch > after and resumed and alive(pid) else None


def _kill(run_dir: Path, rank: int, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _record(run_dir, kind="kill", target_rank=rank, pid=pid)


def _last_step(run_dir: Path) -> int:
    return max(
        (int(e["last"]) for e in events(run_dir, 0) if e.get("event") == "train.progress"),
        default=-1,
    )


def _launch(
    out: Path,
    steps: int,
    save_every: int,
    seed: int,
    *,
    mtbf: float | None,
    rng: random.Random,
    timeout_s: float,
    kill_after_step: int | None = None,
    hot: bool = False,
) -> tuple[int, list[float]]:
    """Run to the end under faults; returns the exit code and the fault times (s from launch).

    With `mtbf`, kill -9 of a random rank after exponential inter-arrival times (mean
    `mtbf`), each drawn when the previous fault is injected. A fault that comes due while the
    group is down or restarting (no attempt newer than the last one killed has resumed yet)
    waits until one has: first-order Young/Daly has no faults inside a restart either. With
    `kill_after_step` instead, one fault once rank 0 has logged that step.
    """
    shutil.rmtree(out, ignore_errors=True)
    run_dir = out / "run"
    (run_dir / "logs").mkdir(parents=True)
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    done: list[float] = []
    killed: Epoch = (-1, -1)
    next_at = rng.expovariate(1 / mtbf) if mtbf else math.inf
    cmd = _cmd(out, steps, save_every, seed, hot)
    with Run(cmd, log_path=out / "launcher.log", env=env) as run:
        while run.proc.poll() is None:
            if run.elapsed > timeout_s:
                run.kill()
                raise TimeoutError(f"run did not finish in {timeout_s:.0f} s: {out}")
            if kill_after_step is not None:
                due = not done and _last_step(run_dir) >= kill_after_step
            else:
                due = run.elapsed >= next_at
            if due:
                rank = rng.randrange(2)
                victim = _victim(run_dir, rank, killed)
                if victim is not None:
                    killed, pid = victim
                    _kill(run_dir, rank, pid)
                    done.append(run.elapsed)
                    if mtbf:
                        next_at = run.elapsed + rng.expovariate(1 / mtbf)
            time.sleep(0.05)
        return run.proc.returncode, done


_PHASES = (
    ("detect", "worker.failed"),
    ("decide", "restart.decided"),
    ("respawn", "attempt.start"),
    ("start", "runtime.init"),
    ("build_load", "runtime.resume"),
)


_HOT_PHASES = (
    ("detect", "recovery.hot.detect"),
    ("replace", "recovery.hot.replace"),
    ("formed", "recovery.hot.formed"),
)


def _hot_breakdown(run_dir: Path) -> list[dict[str, float]]:
    """Per fault of a hot run: seconds from the fault to the survivor noticing the loss, the
    agent starting the replacement (the two race: the agent sees the exit, the survivor a
    closed connection), the new generation formed with its state restored, and the end of its
    first step. Each is counted from the fault; a fault that went cold has no `formed`."""
    evs = load_events(run_dir)
    faults = [e["t"] for e in evs if e.get("event") == "chaos.fault"]
    out = []
    for i, tf in enumerate(faults):
        t_next = faults[i + 1] if i + 1 < len(faults) else math.inf
        row: dict[str, float] = {}
        for name, event in _HOT_PHASES:
            hit = [e["t"] for e in evs if e.get("event") == event and tf <= e["t"] < t_next]
            if hit:
                row[name] = min(hit) - tf
        if "formed" in row:
            first = _first_step_end(evs, tf + row["formed"], t_next)
            if first is not None:
                row["first_step"] = first - tf
        out.append(row)
    return out


def _first_step_end(evs: list[dict], t0: float, t1: float) -> float | None:
    """The end of the first step body rank 0 reported in [t0, t1), or None."""
    ends = [
        float(e["t1_first"])
        for e in evs
        if e.get("event") == "train.progress" and t0 <= e["t"] < t1
    ]
    return min(ends) if ends else None


def _breakdown(run_dir: Path) -> list[dict[str, float]]:
    """Per fault: seconds from the fault to the supervisor seeing the failed worker, its
    decision, the new workers' spawn (backoff included), their runtime.init (process start,
    imports, process groups), their resume (model, DDP, checkpoint load) and the end of the
    first step. Each phase's end is the first such event after the previous one."""
    evs = load_events(run_dir)
    faults = [e["t"] for e in evs if e.get("event") == "chaos.fault"]
    out = []
    for i, tf in enumerate(faults):
        t_next = faults[i + 1] if i + 1 < len(faults) else math.inf
        row, t = {}, tf
        for name, event in _PHASES:
            hit = [e["t"] for e in evs if e.get("event") == event and t <= e["t"] < t_next]
            if not hit:
                break
            row[name], t = min(hit) - t, min(hit)
        else:
            first = _first_step_end(evs, t, t_next)
            if first is not None:
                row["first_step"] = first - t
        out.append(row)
    return out


def _upper(rep: Any, gap_frac: float) -> float | None:
    """The ratio if the time between step bodies counted as productive. That time is the
    runtime's per-step work (the preemption agreement, an all-reduce on the control group)
    plus the wait for the slower rank, which a loop without that all-reduce would spend in
    DDP's gradient all-reduce instead: the truth lies between the two ratios."""
    if not rep.optimal_goodput:
        return None
    p = rep.productive_s * (1 + gap_frac)
    best_run = p / (p / rep.optimal_goodput + rep.startup_s + rep.end_s)
    return round(p / rep.wall_s / best_run, 4)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _summary(rep: Any) -> dict[str, Any]:
    return {
        "wall_s": round(rep.wall_s, 2),
        "startup_s": round(rep.startup_s, 2),
        "end_s": round(rep.end_s, 2),
        "productive_s": round(rep.productive_s, 2),
        "replayed_s": round(rep.replayed_s, 2),
        "save_slowdown_s": round(rep.save_slowdown_s, 2),
        "goodput": round(rep.goodput, 4),
        "steady_goodput": round(rep.steady_goodput, 4),
        "optimal_goodput": None if rep.optimal_goodput is None else round(rep.optimal_goodput, 4),
        "optimal_run_goodput": None
        if rep.optimal_run_goodput is None
        else round(rep.optimal_run_goodput, 4),
        "ratio": None if rep.goodput_over_optimum is None else round(rep.goodput_over_optimum, 4),
        "steady_ratio": None
        if not rep.optimal_goodput
        else round(rep.steady_goodput / rep.optimal_goodput, 4),
        "save_cost_s": None if rep.save_cost_s is None else round(rep.save_cost_s, 4),
        "save_cost_basis": rep.save_cost_basis,
        "blocked_s": None if rep.blocked_s is None else round(rep.blocked_s, 4),
        "restart_cost_s": None if rep.restart_cost_s is None else round(rep.restart_cost_s, 3),
        "step_s": None if rep.step_s is None else round(rep.step_s, 4),
        "between_steps_s": None if rep.step_overhead_s is None else round(rep.step_overhead_s, 5),
        "interval_s": None if rep.interval_s is None else round(rep.interval_s, 2),
        "optimal_interval_s": None
        if rep.optimal_interval_s is None
        else round(rep.optimal_interval_s, 2),
        "faults": len(rep.faults),
        "detect_s": [None if f.detect_s is None else round(f.detect_s, 2) for f in rep.faults],
        "restart_s": [None if f.restart_s is None else round(f.restart_s, 2) for f in rep.faults],
        "steps_lost": [f.steps_lost for f in rep.faults],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="MTBF 20 s, one run of about 60 s")
    ap.add_argument("--mtbf", type=float, default=None, help="mean time between faults (s)")
    ap.add_argument("--duration", type=float, default=None, help="target wall time per run (s)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default=str(REPO / "bench-output" / "goodput"))
    ap.add_argument("--calib-steps", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep run directories and checkpoints")
    ap.add_argument(
        "--hot",
        action="store_true",
        help="resilient run --hot-recovery: a killed rank is replaced while the other lives",
    )
    args = ap.parse_args()
    mtbf = args.mtbf or (20.0 if args.quick else 45.0)
    duration = args.duration or (60.0 if args.quick else 240.0)
    reps = args.reps or (1 if args.quick else 3)
    calib_steps = args.calib_steps or (300 if args.quick else 600)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = "hot recovery" if args.hot else "cold restarts"
    print(
        f"bench_goodput ({mode}): MTBF {mtbf:g} s, {duration:g} s per run, {reps} run(s), in {out}"
    )
    print(f"load at start: {_uptime()}", flush=True)

    # 1. calibration: saves every 50 steps (about 2 s), one kill -9 after 2/3 of the steps
    t = time.monotonic()
    cal = out / "calibration"
    rc, _ = _launch(
        cal,
        calib_steps,
        50,
        args.seed,
        mtbf=None,
        rng=random.Random(args.seed),
        timeout_s=600,
        kill_after_step=calib_steps * 2 // 3,
        hot=args.hot,
    )
    if rc != 0:
        raise SystemExit(f"calibration run failed ({rc}); see {cal / 'launcher.log'}")
    crep = analyze(cal / "run", mtbf_s=mtbf)
    print(format_report(crep))
    c, r, step = crep.save_cost_s, crep.restart_cost_s, crep.step_s
    if c is None or r is None or step is None or crep.step_overhead_s is None:
        raise SystemExit("calibration gave no save cost, restart cost or step time")
    cycle = step + crep.step_overhead_s
    tau, best = young_daly(c, r, mtbf)
    save_every = max(1, round(tau / cycle))
    # enough steps for about `duration` s of wall time at the optimum, start-up included
    steps = max(100, int((duration - crep.startup_s - crep.end_s) * best / step))
    print(
        f"calibration ({time.monotonic() - t:.0f} s): step {step * 1e3:.1f} ms "
        f"(+{crep.step_overhead_s * 1e3:.2f} ms between steps), save cost {c:.4f} s "
        f"({crep.save_cost_basis}; blocked {crep.blocked_s}), restart cost {r:.2f} s -> "
        f"Daly interval {tau:.2f} s = every {save_every} steps, optimum {best:.3f}; "
        f"{steps} steps per run",
        flush=True,
    )

    # 2. measured runs
    results = []
    for i in range(reps):
        rng = random.Random(args.seed + 1 + i)
        run_out = out / f"run{i}"
        t = time.monotonic()
        rc, done = _launch(
            run_out,
            steps,
            save_every,
            args.seed,
            mtbf=mtbf,
            rng=rng,
            timeout_s=6 * duration,
            hot=args.hot,
        )
        if rc != 0:
            raise SystemExit(f"run {i} failed ({rc}); see {run_out / 'launcher.log'}")
        # a short interval leaves no window without a save: then the calibrated cost
        rep = analyze(run_out / "run", mtbf_s=mtbf, save_cost_s=c)
        print(
            f"\n--- run {i} ({time.monotonic() - t:.0f} s, faults at {[round(x, 1) for x in done]})"
        )
        print(format_report(rep))
        res = _summary(rep)
        print(
            f"run {i}: goodput {rep.goodput:.3f}, optimum for this run "
            f"{res['optimal_run_goodput']}, ratio {res['ratio']}; steady state "
            f"{rep.steady_goodput:.3f} vs {res['optimal_goodput']}, ratio {res['steady_ratio']}",
            flush=True,
        )
        res["breakdown"] = (_hot_breakdown if args.hot else _breakdown)(run_out / "run")
        res["ratio_if_between_steps_productive"] = _upper(rep, crep.step_overhead_s / step)
        # the same run against the optimum for the faults it actually had (wall / faults)
        real = analyze(run_out / "run", save_cost_s=c)
        res["realized_mtbf_s"] = None if real.mtbf_s is None else round(real.mtbf_s, 1)
        res["ratio_at_realized_mtbf"] = (
            None if real.goodput_over_optimum is None else round(real.goodput_over_optimum, 4)
        )
        res["ratio_at_realized_mtbf_if_between_steps_productive"] = _upper(
            real, crep.step_overhead_s / step
        )
        results.append(res)
        if not args.keep:
            shutil.rmtree(run_out / "ckpt", ignore_errors=True)
    if not args.keep:
        shutil.rmtree(cal / "ckpt", ignore_errors=True)

    def med(key: str) -> float | None:
        xs = [x[key] for x in results if x[key] is not None]
        return round(statistics.median(xs), 4) if xs else None

    load_end = _uptime()
    print(f"\nload at end: {load_end}")
    medians = {
        k: med(k)
        for k in (
            "goodput",
            "optimal_run_goodput",
            "ratio",
            "steady_goodput",
            "optimal_goodput",
            "steady_ratio",
            "save_cost_s",
            "restart_cost_s",
            "wall_s",
            "faults",
            "ratio_if_between_steps_productive",
            "realized_mtbf_s",
            "ratio_at_realized_mtbf",
            "ratio_at_realized_mtbf_if_between_steps_productive",
        )
    }
    rows = [row for x in results for row in x["breakdown"]]
    phases = [name for name, _ in (_HOT_PHASES if args.hot else _PHASES)] + ["first_step"]
    recovery = {
        k: round(statistics.median([r[k] for r in rows if k in r]), 3)
        for k in phases
        if any(k in r for r in rows)
    }
    what = "from the fault to each phase's end" if args.hot else "per phase"
    print(f"recovery, median seconds {what} over all faults: " + json.dumps(recovery))
    summary: dict[str, Any] = {
        "mode": "hot" if args.hot else "cold",
        "mtbf_s": mtbf,
        "reps": reps,
        "steps": steps,
        "save_every": save_every,
        "calibration": _summary(crep),
        "median": medians,
        "recovery_phases": recovery,
        "runs": results,
        "load_end": load_end,
    }
    print(
        f"median goodput {medians['goodput']} against an optimum of "
        f"{medians['optimal_run_goodput']}: ratio {medians['ratio']} "
        f"(target >= 0.95)"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
