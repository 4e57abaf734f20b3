"""Repeat issue 31's scenario and count hot and cold recoveries.

    .venv/bin/python scripts/hot_sigstop_reps.py ddp 30
    .venv/bin/python scripts/hot_sigstop_reps.py fsdp 30

Each run: tests/workers/guarded_train.py on 2 ranks under `resilient run --hot-recovery`
(snapshots every step, the tests' short watchdog), rank 1 SIGSTOPs itself at step 5 and the
survivor's watchdog kills it. One JSON line a run, then a summary line: hot and cold counts,
and runs whose final state differs from a fault-free run's. Uses test_hot.py's launcher.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import test_hot as hot  # noqa: E402


def main() -> None:
    fsdp, runs = sys.argv[1] == "fsdp", int(sys.argv[2])
    worker = ("--fsdp",) if fsdp else ()
    golden = pathlib.Path(tempfile.mkdtemp())
    hot._run(golden, 2, [], worker=worker)
    digest = hot._digest(golden)
    counts = {"hot": 0, "cold": 0, "not_equal": 0}
    for i in range(runs):
        out, t0 = pathlib.Path(tempfile.mkdtemp()), time.time()
        fault = ["stop@rank=1,step=5,phase=forward"]
        code, _ = hot._run(out, 2, fault, "--hot-recovery", worker=worker)
        cold = hot._events(out, "recovery.cold")
        went_hot = bool(hot._events(out, "recovery.hot.replace")) and not cold
        equal = code == 0 and hot._digest(out) == digest
        counts["hot" if went_hot else "cold"] += 1
        counts["not_equal"] += not equal
        line = {"i": i, "code": code, "hot": went_hot, "cold": [e.get("reason") for e in cold]}
        print(json.dumps({**line, "bitwise_equal": equal, "s": round(time.time() - t0, 1)}))
    print(json.dumps({"fsdp": fsdp, "runs": runs, **counts}))


if __name__ == "__main__":
    main()
