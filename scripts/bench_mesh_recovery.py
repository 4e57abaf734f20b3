"""Hot recovery against a cold restart on 4-rank meshes, side by side (issues 36 and 37).

    python scripts/bench_mesh_recovery.py                 # every mesh, 3 rounds
    python scripts/bench_mesh_recovery.py --rounds 1 --mesh hsdp --mesh pp4

scripts/bench_recovery.py measures one DDP or FSDP2 world; this does the same for the mesh
shapes of tests/workers/mesh_train.py (FSDP2 over the data-parallel dimensions, tensor
parallel over "tp"): dp 2 x tp 2 ("dp_tp") and HSDP replicate 2 x shard 2 ("hsdp"); and for
the pipelines of tests/workers/pipeline_train.py (1F1B): 2 stages x DDP 2 ("pp2_dp2") and 4
stages ("pp4"). Each round launches every shape twice under `resilient run
--max-restarts 1`, once with `--hot-recovery` (snapshots on, the default adaptive interval)
and once without (the cold restart from the newest checkpoint), alternated, with
chaos.inject SIGKILLing rank 3 as it enters the forward of step `--kill-at` (one step after
a checkpoint). The time is from the kill (the fault's own timestamp) to the first step that
every rank completes afterwards (the worker's per-step records); steps lost = the kill's
step - that first step. Per shape:
the medians, hot/cold, and the snapshot memory per rank of the hot run (`snapshot.memory`:
bytes of one copy, copies held, bytes of replicas held for another rank).

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resilient.events import read_events

REPO = Path(__file__).resolve().parent.parent
MESH = ["tests/workers/mesh_train.py", "--steps"]
PIPE = ["tests/workers/pipeline_train.py", "--schedule=1f1b", "--batch=8", "--steps"]
SHAPES = {  # the worker and its mesh flags; the steps go after the worker's first flags
    "dp_tp": (MESH, ["--dp-replicate=1", "--dp-shard=2", "--tp=2"]),
    "hsdp": (MESH, ["--dp-replicate=2", "--dp-shard=2", "--tp=1"]),
    "pp2_dp2": (PIPE, ["--pp=2", "--dp=2"]),
    "pp4": (PIPE, ["--pp=4", "--dp=1"]),
}


def _launch(out: Path, shape: str, hot: bool, steps: int, kill_at: int) -> None:
    worker, flags = SHAPES[shape]
    cmd = [sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", "1", "--run-dir", str(out / "run")]
    cmd += ["--checkpoint-url", str(out / "ckpt"), *(["--hot-recovery"] if hot else [])]
    cmd += ["-m", "chaos.inject", "--fault", f"kill@rank=3,step={kill_at},phase=forward", "--"]
    cmd += [*worker, str(steps), "--record", str(out / "rec"), "--save-every", "4", *flags]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if hot:
        env["RESILIENT_SNAPSHOT"] = json.dumps({"enabled": True})
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _measure(out: Path, kill_at: int, hot: bool) -> dict[str, Any]:
    (fault,) = read_events(out / "run", "chaos.fault")
    t_kill = float(fault["time"])
    recs = read_events(out / "rec", pattern="rank*.jsonl")
    first: dict[int, dict[str, Any]] = {}
    for r in sorted(recs, key=lambda r: r["t"]):
        if r["t"] > t_kill:
            first.setdefault(int(r["rank"]), r)
    assert sorted(first) == [0, 1, 2, 3], first
    step = min(r["step"] for r in first.values())
    row: dict[str, Any] = {
        "total_s": round(max(r["t"] for r in first.values()) - t_kill, 3),
        "steps_lost": kill_at - step,
    }
    cold = read_events(out / "run", "recovery.cold")
    row["went_cold"] = bool(cold) if hot else None
    if hot:
        mem = [e for e in read_events(out / "run", "snapshot.memory") if e.get("measured")]
        row["memory"] = {
            str(e["rank"]): {k: e.get(k) for k in ("bytes_per_copy", "copies", "replica_bytes")}
            for e in mem
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mesh", choices=list(SHAPES), action="append", help="default: all")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=9)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.out or tempfile.mkdtemp(prefix="bench_mesh_"))
    shapes = args.mesh or list(SHAPES)
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {s: {"hot": [], "cold": []} for s in shapes}
    for rnd in range(args.rounds):
        for shape in shapes:
            for mode in ("hot", "cold") if rnd % 2 == 0 else ("cold", "hot"):
                out = base / f"{shape}_{mode}_{rnd}"
                t0 = time.monotonic()
                _launch(out, shape, mode == "hot", args.steps, args.kill_at)
                row = _measure(out, args.kill_at, mode == "hot")
                rows[shape][mode].append(row)
                print(f"round {rnd} {shape} {mode}: {row} ({time.monotonic() - t0:.0f} s)")
    result: dict[str, Any] = {"rounds": args.rounds, "kill_at": args.kill_at, "out": str(base)}
    for shape in shapes:
        hot = statistics.median(r["total_s"] for r in rows[shape]["hot"])
        cold = statistics.median(r["total_s"] for r in rows[shape]["cold"])
        result[shape] = {
            "hot_s": hot,
            "cold_s": cold,
            "hot_over_cold": round(hot / cold, 3),
            "hot_steps_lost": [r["steps_lost"] for r in rows[shape]["hot"]],
            "cold_steps_lost": [r["steps_lost"] for r in rows[shape]["cold"]],
            "hot_went_cold": [r["went_cold"] for r in rows[shape]["hot"]],
            "memory_per_rank": rows[shape]["hot"][-1]["memory"],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
