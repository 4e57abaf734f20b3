"""Live metrics overhead: the same `resilient run` with and without --metrics-port and a status
line, alternated.

    .venv/bin/python scripts/bench_metrics.py            # 3 rounds, about 5 minutes
    .venv/bin/python scripts/bench_metrics.py --quick    # 2 rounds

Each run is recipes/train_ddp.py on 2 ranks under `resilient run` (no checkpoint but the final
one). "off": `--status off`, no metrics port: the supervisor starts no monitor. "on":
`--metrics-port 0 --status plain --status-every 1`, and a thread of this script scrapes
/metrics every second (Prometheus' default is every 15 s: a stricter case), so the monitor
follows the logs, folds the events, recomputes the goodput every 10 s, prints a status line
every second and answers the scrapes. "again": "off" once more, an A/A control whose
difference from "off" is the noise floor of the comparison. The variants alternate in
rounds (off, on, again, off, on, ...) so a drift of the machine's load touches all alike.

Step time comes from rank 0's `train.progress` events after the first --warmup steps: the
step bodies' time over their count (busy_s / steps), and, as a check, the whole span from the
first such window's start to the last one's end over the steps in it (the time between step
bodies included). On a machine that others load too, the load slows some windows of a run and
not others: the 10th percentile of a run's windows' step times (busy_s / steps of each window
of about a second, each holding one poll and one scrape of the monitor) is compared as well
(`metrics_overhead_p10`), the figure least moved by the others' load. The overhead is the
median of "on" over the median of "off", minus 1; the median of the paired ratios (each "on"
run over the "off" run before it) is reported too, and the supervisor process's own CPU
seconds (not its workers') per run. On a shared machine
the step times of two runs differ by more than the effect measured, so the monitor's cost is
also accounted directly: the CPU seconds of its thread and of the scrapes (its `live.stopped`
event) over the CPU time of the ranks while they trained (2 ranks x the training span): the
most it could take from the steps if every core were busy (`metrics_overhead_direct`). The
last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from resilient.events import latest_event, read_events
from resilient.live.status import StatusLine

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds of the variants (default 3)")
    p.add_argument("--steps", type=int, default=600, help="steps per run (~20 s here)")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start")
    p.add_argument("--dir", default=None, help="scratch parent (default ./bench-output/)")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = p.parse_args()
    args.runs = args.runs or (2 if args.quick else 3)
    return args


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


class _Scraper(threading.Thread):
    """GET /metrics every second once the run logged its port."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.stop = threading.Event()
        self.ok = self.failed = 0
        self.bytes = 0

    def run(self) -> None:
        port = None
        while not self.stop.wait(1.0):
            if port is None:
                e = latest_event(self.run_dir / "logs" / "supervisor.jsonl", "metrics.serving")
                port = None if e is None else int(e["port"])
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    self.bytes += len(r.read())
                self.ok += 1
            except OSError:
                self.failed += 1


def one_run(work: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = work / "run"
    flags = (
        ["--metrics-port=0", "--metrics-addr=127.0.0.1", "--status=plain", "--status-every=1"]
        if name == "on"
        else ["--status=off"]
    )
    cmd = [
        sys.executable, "-m", "resilient.cli", "run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=0", "--no-health-check", f"--run-dir={run_dir}", *flags,
        str(REPO / "recipes" / "train_ddp.py"), f"--steps={args.steps}",
        f"--save-every={10 * args.steps}", "--corpus-chars=20000", "--batch-size=8",
        "--log-every=100000", f"--ckpt-dir={work / 'ckpt'}", f"--run-dir={run_dir}",
    ]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    scraper = _Scraper(run_dir)
    t0 = time.time()
    with (work / "output.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        if name == "on":
            scraper.start()
        sup = psutil.Process(proc.pid)
        cpu = 0.0
        while proc.poll() is None:
            try:
                c = sup.cpu_times()
                cpu = c.user + c.system  # the supervisor's own, not its workers'
            except psutil.Error:
                pass
            time.sleep(0.5)
    scraper.stop.set()
    if proc.returncode != 0:
        tail = (work / "output.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name} run failed with code {proc.returncode}:\n{tail}")
    wins = [
        w for w in read_events(run_dir, "train.progress", rank=0) if int(w["first"]) >= args.warmup
    ]
    steps = sum(int(w["last"]) - int(w["first"]) + 1 for w in wins)
    busy = sum(float(w["busy_s"]) for w in wins)
    span = max(float(w["t1"]) for w in wins) - min(float(w["t0"]) for w in wins)
    per_window = sorted(float(w["busy_s"]) / (int(w["last"]) - int(w["first"]) + 1) for w in wins)
    stopped = latest_event(run_dir / "logs" / "supervisor.jsonl", "live.stopped")
    return {
        "step_s": busy / steps,
        "span_step_s": span / steps,
        "p10_step_s": per_window[len(per_window) // 10],
        "steps": steps,
        "wall_s": time.time() - t0,
        "supervisor_cpu_s": cpu,
        "monitor_cpu_s": float(stopped["cpu_s"]) if stopped else 0.0,
        "train_s": span,
        "scrapes": scraper.ok,
        "scrape_failures": scraper.failed,
    }


def main() -> int:
    args = parse_args()
    parent = Path(args.dir) if args.dir else REPO / "bench-output"
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench_metrics_", dir=parent))
    got: dict[str, list[dict[str, Any]]] = {"off": [], "on": [], "again": []}
    total = len(got) * args.runs
    progress = StatusLine(mode="auto", every_s=30.0, prefix="bench_metrics: ")
    try:
        for i in range(args.runs):
            for name in got:
                done = sum(len(runs) for runs in got.values())
                progress.show(f"run {done + 1} of {total} ({name})", force=True)
                got[name].append(one_run(base / f"{i}-{name}", name, args))
        progress.close(f"{total} runs done")
    finally:
        progress.close()
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in got[name])

    paired = [on["step_s"] / off["step_s"] for off, on in zip(got["off"], got["on"], strict=True)]
    overhead = med("on", "step_s") / med("off", "step_s") - 1
    aa = med("again", "step_s") / med("off", "step_s") - 1
    p10 = med("on", "p10_step_s") / med("off", "p10_step_s") - 1
    aa_p10 = med("again", "p10_step_s") / med("off", "p10_step_s") - 1
    span_overhead = med("on", "span_step_s") / med("off", "span_step_s") - 1
    direct = [r["monitor_cpu_s"] / (2 * r["train_s"]) for r in got["on"]]
    cpu_on = [r["supervisor_cpu_s"] / r["wall_s"] for r in got["on"]]
    cpu_off = [r["supervisor_cpu_s"] / r["wall_s"] for r in got["off"]]
    for name in got:
        print(
            f"{name:>5}: step {1e3 * med(name, 'step_s'):.3f} ms (busy), "
            f"{1e3 * med(name, 'span_step_s'):.3f} ms (span), "
            f"{1e3 * med(name, 'p10_step_s'):.3f} ms (p10 of windows), supervisor CPU "
            f"{med(name, 'supervisor_cpu_s'):.2f} s per run of {med(name, 'wall_s'):.1f} s"
        )
    print(
        f"metrics overhead {100 * overhead:+.2f} % of step time (paired median "
        f"{100 * (statistics.median(paired) - 1):+.2f} %, span {100 * span_overhead:+.2f} %); "
        f"direct: the monitor's CPU {med('on', 'monitor_cpu_s'):.3f} s per run = "
        f"{100 * statistics.median(direct):.3f} % of the ranks' CPU time; target <= 0.5 %. "
        f"A/A noise floor (again over off): {100 * aa:+.2f} %. By the p10 of windows: "
        f"{100 * p10:+.2f} % (A/A {100 * aa_p10:+.2f} %)"
    )
    if abs(aa) > 0.005:
        print(
            "the A/A control differs by more than the target: others loaded the machine during "
            "the runs; metrics_overhead_p10 and metrics_overhead_direct are the figures to read"
        )
    print(
        json.dumps(
            {
                "bench": "metrics",
                "runs": args.runs,
                "steps": args.steps,
                "warmup": args.warmup,
                "metrics_overhead": round(overhead, 5),
                "metrics_overhead_paired": round(statistics.median(paired) - 1, 5),
                "metrics_overhead_span": round(span_overhead, 5),
                "metrics_overhead_direct": round(statistics.median(direct), 6),
                "aa_noise": round(aa, 5),
                "metrics_overhead_p10": round(p10, 5),
                "aa_noise_p10": round(aa_p10, 5),
                "supervisor_cpu_fraction": {
                    "off": round(statistics.median(cpu_off), 5),
                    "on": round(statistics.median(cpu_on), 5),
                },
                "raw": {
                    name: [{k: round(v, 6) for k, v in r.items()} for r in runs]
                    for name, runs in got.items()
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
