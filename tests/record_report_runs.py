"""Record the event logs of tests/data/report_runs/ from real short runs (tests/test_report.py).

    .venv/bin/python tests/record_report_runs.py            # all three, about 2 minutes
    .venv/bin/python tests/record_report_runs.py stopped    # one of them

Each run is a real `resilient run` of 2 ranks on gloo with faults armed by chaos.inject:
- stopped: tests/workers/guarded_train.py with --hot-recovery and a snapshot every step;
  rank 1 SIGSTOPs itself in its forward of step 5; the watchdog (3 s timeouts) names it,
  rank 0 kills it and a warm spare replaces it hot.
- numeric: recipes/train_ddp.py without snapshots: a NaN in rank 0's forward of step 6 (a
  cold restart from the newest checkpoint), then rank 1 SIGKILLed at step 10 (a cold restart
  again).
- hot: guarded_train.py with --hot-recovery and a snapshot every step: an exception in rank
  1's backward of step 3 (rolled back in place), an OOM in rank 0's forward of step 5 (retried
  in smaller micro-batches), rank 1 SIGKILLed at step 7 (replaced hot).
Only the logs are kept (logs/*.jsonl), chaos.jsonl among them: the test reads each run as it
is and once more without the harness's record, the way a user's run without chaos reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "report_runs"
WATCHDOG = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3.0, "timeout_s": 3.0}
SNAPSHOTS = {"enabled": True, "every_steps": 1}
GUARDED = ["tests/workers/guarded_train.py", "--mode", "micro", "--steps", "10", "--workers", "0"]
RECIPE = ["recipes/train_ddp.py", "--steps", "14", "--save-every", "4", "--log-every", "1",
          "--corpus-chars", "20000", "--batch-size", "8"]  # fmt: skip

RUNS = {
    "stopped": (["stop@rank=1,step=5,phase=forward"], GUARDED, True),
    "numeric": (
        ["nan@rank=0,step=6,phase=forward", "kill@rank=1,step=10,restart=1"],
        RECIPE,
        False,
    ),
    "hot": (
        [
            "raise@rank=1,step=3,phase=backward",
            "oom@rank=0,step=5,phase=forward",
            "kill@rank=1,step=7",
        ],
        GUARDED,
        True,
    ),
}


def record(name: str) -> None:
    faults, script, hot = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node", "2",
               "--max-restarts", "3", "--monitor-interval", "0.05", "--restart-backoff", "0.1",
               "--restart-jitter", "0", "--run-dir", str(run), *(["--hot-recovery"] if hot else []),
               "-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--",
               *script, "--ckpt-dir", str(Path(tmp) / "ckpt"), "--run-dir", str(run)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "RESILIENT_WATCHDOG": json.dumps(WATCHDOG)}
        if hot:
            env["RESILIENT_SNAPSHOT"] = json.dumps(SNAPSHOTS)
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=300)
        dst = OUT / name / "logs"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in sorted((run / "logs").glob("*.jsonl")):
            shutil.copy(f, dst / f.name)


if __name__ == "__main__":
    for name in sys.argv[1:] or list(RUNS):
        record(name)
