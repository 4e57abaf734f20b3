"""Recovery under `resilient run`: kill -9 of one rank until the first step after the restart,
and SIGTERM with a grace period (steps lost, time to commit).

    python scripts/bench_recovery.py            # 2 ranks, ~100 MB checkpoint, 3 kills
    python scripts/bench_recovery.py --quick    # ~6 MB checkpoint, 1 kill; under a minute

One launch of scripts/_recovery_worker.py (an MLP with AdamW, DDP on 2 ranks, a synchronous
checkpoint every 5 steps). Each kill -9 of rank 1 is timed from the kill to the first step
that every rank completes afterwards, split from the events the supervisor and the ranks
log: detection (kill -> the supervisor sees the exit), restart (-> new processes spawned
after the rendezvous; -> process group ready in the new ranks), load (-> resume done) and
first step. The floor, measured in the same run once training is over: a bare
`python -c "import torch; dcp.load(<the same checkpoint>)"`, from spawn to loaded; also with
one such process per rank side by side, as the restart runs them. Then SIGTERM goes to the
launcher: steps lost (last completed step + 1 - committed step; target 0) and the time from
the signal to the committed checkpoint and to the launcher's exit.

Hot path (issue 10), in the same run, on the same model: in-place rollback of a Python
exception. Two more launches with a chaos `raise` in rank 1's forward at one step, run
through rt.micro_batches: with in-memory snapshots on (the group rolls back in place, no
process lost) and off (today's cold path: every rank exits, the supervisor restarts the
group, which resumes from the last checkpoint). Each is timed from the fault to the first
step every rank completes afterwards. Snapshot overhead: fault-free launches without the
sleep between steps, snapshots off, every step and at the default (adaptive) interval,
alternated; the mean time per step of each (a snapshot every few steps costs those steps
only, which a median would not show; the median's ratios are reported too); the ratio
on/off, median over the pairs.

Hot path for a lost process, in the same run, on the same model: one more launch under
`resilient run --hot-recovery` (snapshots at the default, adaptive interval), kill -9 of rank
1 mid-run; timed from the kill to the first step every rank completes after the new
generation formed, split into detection (-> the survivor's recovery.hot.detect), the agent's
replacement (-> recovery.hot.replace, a warm spare), re-formation and state transfer (->
recovery.hot.formed on every rank: the survivor re-ran its script, the replacement joined)
and the first step. `hot_over_cold` and `hot_over_floor` compare it with the cold kill -9
cycles and the one-process floor above.

The last line of output is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from resilient.events import read_events
from resilient.live.status import StatusLine

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_recovery_worker.py"

FLOOR = r"""
import sys, time
import torch
if sys.argv[2:] == ["dynamo"]:
    import torch._dynamo  # what DDP's constructor imports lazily (the script pays it too)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
reader = dcp.FileSystemReader(sys.argv[1])
md = reader.read_metadata()
sd = {k: torch.empty(v.size, dtype=v.properties.dtype)
      for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
dcp.load(sd, storage_reader=reader, no_dist=True)
print(time.time(), sum(t.numel() * t.element_size() for t in sd.values()), flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    out = read_events(run_dir, name)
    for rec in out:
        rec["_t"] = _ts(rec["ts"])
    return out


def _records(rec_dir: Path) -> list[dict[str, Any]]:
    return read_events(rec_dir, pattern="rank*.jsonl")


def _wait(pred: Any, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (code {proc.returncode}) while waiting for {what}")
        time.sleep(0.02)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def _committed(ckpt: Path) -> list[int]:
    return sorted(
        int(d.name.split("_")[1]) for d in ckpt.glob("step_*") if (d / "manifest.json").exists()
    )


def _kill_cycle(run_dir: Path, rec: Path, ckpt: Path, proc: subprocess.Popen[bytes]) -> dict:
    """Wait for a fresh checkpoint and two more steps, kill -9 rank 1, time the recovery."""
    last = max(_committed(ckpt), default=-1)
    _wait(lambda: max(_committed(ckpt), default=-1) > last, 120, "a new checkpoint", proc)
    target = max(_committed(ckpt)) + 2
    _wait(lambda: any(r.get("step", -1) >= target for r in _records(rec)), 60, "steps", proc)
    inits = _events(run_dir, "runtime.init")
    pid = max((e for e in inits if e["rank"] == 1), key=lambda e: e["_t"])["pid"]
    attempts_before = {r.get("attempt") for r in _records(rec)}
    t_kill = time.time()
    os.kill(int(pid), signal.SIGKILL)

    def new_records() -> list[dict[str, Any]]:
        return [r for r in _records(rec) if r.get("attempt") not in attempts_before and "t" in r]

    def first_step_done() -> bool:
        recs = new_records()
        return len({r["rank"] for r in recs}) == 2

    _wait(first_step_done, 180, "the first step after the restart", proc)
    recs = new_records()
    first = min(r["step"] for r in recs)
    t_step = max(r["t"] for r in recs if r["step"] == first)
    after = [
        e
        for name in ("restart.kill_survivors", "worker.failed")
        for e in _events(run_dir, name)
        if e["_t"] >= t_kill - 0.01
    ]
    t_detect = min(e["_t"] for e in after)
    t_spawn = min(e["_t"] for e in _events(run_dir, "attempt.start") if e["_t"] >= t_detect)
    t_init = max(e["_t"] for e in _events(run_dir, "runtime.init") if e["_t"] >= t_spawn)
    resumes = [e for e in _events(run_dir, "runtime.resume") if e["_t"] >= t_init]
    t_resume = max(e["_t"] for e in resumes)
    loads = [e for e in _events(run_dir, "ckpt.load") if e["_t"] >= t_init]
    return {
        "total_s": round(t_step - t_kill, 3),
        "detection_s": round(t_detect - t_kill, 3),
        "restart_s": round(t_init - t_detect, 3),
        "stop_rendezvous_spawn_s": round(t_spawn - t_detect, 3),
        "process_start_import_pg_s": round(t_init - t_spawn, 3),
        "load_s": round(t_resume - t_init, 3),
        "dcp_load_s": round(max(e["seconds"] for e in loads), 3) if loads else None,
        "first_step_s": round(t_step - t_resume, 3),
        "resumed_at": resumes[0]["step"],
        "first_step": first,
    }


def _cmd(base: Path, width: int, grace: float, *worker: str) -> list[str]:
    return [
        sys.executable, "-m", "resilient.cli", "run",
        "--nproc-per-node=2",
        f"--run-dir={base / 'run'}",
        f"--checkpoint-url={base / 'ckpt'}",
        f"--grace-period={grace}",
        "--restart-jitter=0",
        str(WORKER),
        f"--record={base / 'rec'}",
        f"--width={width}",
        *worker,
    ]  # fmt: skip


def _launch_to_end(base: Path, cmd: list[str], snapshot: dict[str, Any]) -> None:
    base.mkdir(parents=True, exist_ok=True)
    env = {**_env(), "RESILIENT_SNAPSHOT": json.dumps(snapshot)}
    with (base / "launcher.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        raise SystemExit(f"{base.name}: the launch exited {code}; see {base / 'launcher.log'}")


def _exception_recovery(
    base: Path, width: int, hot: bool, fault_step: int, model: str = "--micro"
) -> dict[str, Any]:
    """A chaos raise in rank 1's forward at `fault_step`; fault to the first step after it.
    `hot`: snapshots on, so DDP's micro-batches roll back in place (FSDP2 has no in-place
    path: `_hot_kill(raise_at=True)` is its hot one)."""
    fault = f"raise@rank=1,step={fault_step},phase=forward"
    worker = ["--steps", str(fault_step + 6), "--save-every=5", "--sync", "--sleep=0.05"]
    cmd = _cmd(base, width, 10.0, *worker, model, f"--fault={fault}")
    _launch_to_end(base, cmd, {"enabled": hot})
    run_dir, recs = base / "run", [r for r in _records(base / "rec") if "t" in r]
    t_fault = min(e["time"] for e in _events(run_dir, "chaos.fault"))
    out: dict[str, Any] = {"hot": hot, "fault_step": fault_step}
    if hot:
        (agreed, *_) = _events(run_dir, "rollback.agreed")
        done = _events(run_dir, "rollback.done")
        to = int(agreed["to_step"])
        # per rank, the last record of the step rolled back to (the aborted body's own
        # record of the failing step comes first)
        t_step = max(
            max(r["t"] for r in recs if r["rank"] == rank and r["step"] == to and r["t"] > t_fault)
            for rank in (0, 1)
        )
        out |= {
            "agree_s": round(agreed["_t"] - t_fault, 3),
            "restore_s": max(e["seconds"] for e in done),
            "resumed_at": to,
            "steps_lost": fault_step - to,
            "processes_replaced": len(_events(run_dir, "runtime.init")) - 2,
        }
    else:
        first = recs[0]["attempt"]
        after = [r for r in recs if r["attempt"] != first]
        step0 = min(r["step"] for r in after)
        t_step = max(r["t"] for r in after if r["step"] == step0)
        resumes = [e for e in _events(run_dir, "runtime.resume") if e["_t"] > t_fault]
        out |= {"resumed_at": resumes[0]["step"], "steps_lost": fault_step - resumes[0]["step"]}
    out["total_s"] = round(t_step - t_fault, 3)
    return out


def _hot_kill(
    base: Path, width: int, kill_at: int = 20, fsdp: bool = False, raise_at: bool = False
) -> dict[str, Any]:
    """kill -9 of rank 1 under --hot-recovery at step `kill_at`; kill to the first step after.
    With `fsdp` the replacement's shards come from its buddy's replica. `raise_at`: instead
    of the kill, rank 1's forward raises at that step (chaos) and the rank is replaced hot;
    timed from the fault."""
    cmd = _cmd(base, width, 10.0, "--steps", str(kill_at + 15), "--save-every=5", "--sync")
    cmd[4:4] = ["--hot-recovery", "--monitor-interval=0.05"]
    cmd += ["--sleep=0.05", "--fsdp" if fsdp else "--micro"]
    if raise_at:
        cmd += [f"--fault=raise@rank=1,step={kill_at},phase=forward"]
    base.mkdir(parents=True, exist_ok=True)
    run_dir, rec = base / "run", base / "rec"
    env = {**_env(), "RESILIENT_SNAPSHOT": json.dumps({"enabled": True})}
    with (base / "launcher.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            _wait(
                lambda: any(r.get("step", -1) >= kill_at for r in _records(rec)), 180, "steps", proc
            )
            pid = max(
                (e for e in _events(run_dir, "runtime.init") if e["rank"] == 1),
                key=lambda e: e["_t"],
            )["pid"]
            t_kill = time.time()
            if not raise_at:
                os.kill(int(pid), signal.SIGKILL)
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        raise SystemExit(f"the hot launch exited {code}; see {base / 'launcher.log'}")
    if raise_at:
        t_kill = min(e["time"] for e in _events(run_dir, "chaos.fault"))
    detect = [e for e in _events(run_dir, "recovery.hot.detect") if e["_t"] >= t_kill - 0.01]
    replace = _events(run_dir, "recovery.hot.replace")
    formed = _events(run_dir, "recovery.hot.formed")
    if not detect or not replace or len(formed) < 2:
        raise SystemExit(f"no hot recovery after the kill; see {base / 'launcher.log'}")
    t_formed = max(e["_t"] for e in formed)
    recs = [r for r in _records(rec) if "t" in r and r["t"] > t_formed]
    t_step = max(min(r["t"] for r in recs if r["rank"] == rank) for rank in (0, 1))
    survivor = next(e for e in formed if e.get("survivor"))
    return {
        "total_s": round(t_step - t_kill, 3),
        "detection_s": round(min(e["_t"] for e in detect) - t_kill, 3),
        "replace_s": round(replace[0]["_t"] - t_kill, 3),
        "reform_transfer_s": round(t_formed - min(e["_t"] for e in detect), 3),
        "transfer_s": max(float(e["transfer_s"]) for e in formed),
        "first_step_s": round(t_step - t_formed, 3),
        "warm_spare": bool(replace[0].get("warm_spare")),
        "resumed_at": int(survivor["to_step"]),
        "steps_lost": int(survivor["steps_lost"]),
        "processes_replaced": len({e["pid"] for e in _events(run_dir, "runtime.init")}) - 2,
    }


SETTLED = 40
"""Steps the overhead runs leave out: warm-up, and the adaptive interval's first two
agreements (at 4 steps and at 32), after which it holds (memory/snapshot.py)."""


def _per_step(rec: Path, skip: int) -> tuple[float, float]:
    """Mean and median seconds between rank 0's completed steps after the first `skip`.
    The mean is what a cost paid every few steps adds to the run; the median of a run that
    snapshots every 4th step shows the other three."""
    ts = sorted(r["t"] for r in _records(rec) if r.get("rank") == 0 and "t" in r)[skip:]
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    return statistics.fmean(gaps), statistics.median(gaps)


def _within_launch(rec: Path, every: int) -> float | None:
    """The adaptive variant's overhead inside one launch: the mean step over the mean of the
    steps that no snapshot touched (neither the snapshot step nor the two after it, where
    the copy and the buddy exchange run), after the first SETTLED steps, minus 1. Launches
    differ in speed by more than the effect measured (a whole launch ran 8-20% slower than
    the one beside it here); within one launch they do not. None at an interval under 4."""
    ts = sorted((r["step"], r["t"]) for r in _records(rec) if r.get("rank") == 0 and "t" in r)
    gaps = [(b[0], b[1] - a[1]) for a, b in itertools.pairwise(ts) if b[0] > SETTLED]
    clean = [g for s, g in gaps if all((s - k) % every for k in (0, 1, 2))]
    if every < 4 or not clean:
        return None
    return statistics.fmean(g for _, g in gaps) / statistics.fmean(clean) - 1


def _snapshot_overhead(
    base: Path, width: int, steps: int, pairs: int, fsdp: bool = False
) -> dict[str, Any]:
    """Fault-free launches, snapshots off / every step / adaptive, interleaved `pairs` times;
    the median seconds per step of each, and each variant's ratio to the off run beside it.
    With `fsdp` the snapshot variants run under --hot-recovery, so each snapshot also goes to
    the buddy (its replication is part of the cost)."""
    worker = ["--steps", str(steps), "--save-every=100000", "--sleep=0"]
    if fsdp:
        worker.append("--fsdp")
    variants = {"off": {"enabled": False}, "every_step": {"enabled": True, "every_steps": 1}}
    variants["adaptive"] = {"enabled": True}
    per: dict[str, list[float]] = {k: [] for k in variants}
    per_median: dict[str, list[float]] = {k: [] for k in variants}
    every: list[int] = []
    final: list[int] = []
    within: list[float] = []
    copy_over_step: list[float] = []
    progress = _Runs("snapshot overhead", pairs * len(variants))
    for i in range(pairs):
        for name, snap in variants.items():
            progress.next(name)
            d = base / f"overhead{i}-{name}"
            cmd = _cmd(d, width, 10.0, *worker)
            if fsdp and snap["enabled"]:
                cmd[4:4] = ["--hot-recovery"]
            _launch_to_end(d, cmd, snap)
            mean, median = _per_step(d / "rec", SETTLED if steps >= 2 * SETTLED else 5)
            per[name].append(mean)
            per_median[name].append(median)
            if name == "adaptive":  # the copies' own timing, as the ranks measured it
                agreed = _events(d / "run", "snapshot.interval")
                if agreed:
                    final.append(agreed[-1]["every_steps"])
                    inside = _within_launch(d / "rec", agreed[-1]["every_steps"])
                    if inside is not None:
                        within.append(inside)
                for e in agreed:
                    every.append(e["every_steps"])
                    if e.get("copy_s") and e.get("step_s"):
                        copy_over_step.append(e["copy_s"] / e["step_s"])
    progress.done()
    ratio = _over_off(per, ("every_step", "adaptive"))
    ratio_median = _over_off(per_median, ("every_step", "adaptive"))
    return {
        "step_s": {k: [round(x, 5) for x in v] for k, v in per.items()},
        "ratios": {k: [round(x, 4) for x in v] for k, v in ratio.items()},
        "median_step_s": {k: [round(x, 5) for x in v] for k, v in per_median.items()},
        "median_ratios": {k: [round(x, 4) for x in v] for k, v in ratio_median.items()},
        "steps": steps,
        "settled_after": SETTLED if steps >= 2 * SETTLED else 5,
        "intervals_chosen": sorted(set(every)),
        "final_intervals": final,
        # one copy over one step (medians each rank measured): the cost of a snapshot every
        # step without the launches' noise; divided by the interval: at the default
        "copy_over_step": round(statistics.median(copy_over_step), 4) if copy_over_step else None,
        "copy_over_step_at_interval": round(
            statistics.median(copy_over_step) / statistics.median(every), 4
        )
        if copy_over_step
        else None,
        "snapshot_overhead": round(statistics.median(ratio["every_step"]) - 1, 4),
        "snapshot_overhead_adaptive": round(statistics.median(ratio["adaptive"]) - 1, 4),
        "adaptive_within_launch": [round(x, 4) for x in within],
        "snapshot_overhead_adaptive_within_launch": round(statistics.median(within), 4)
        if within
        else None,
        "snapshot_overhead_adaptive_by_median_step": round(
            statistics.median(ratio_median["adaptive"]) - 1, 4
        ),
    }


class _Runs:
    """The runs done of a series, on one status line on stderr (stdout's last line stays the
    JSON result)."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.n = what, total, 0
        self.t0 = time.monotonic()
        self.line = StatusLine(mode="auto", prefix="bench_recovery: ")

    def next(self, name: str) -> None:
        took = f", {time.monotonic() - self.t0:.0f} s so far" if self.n else ""
        self.line.show(f"{self.what}: run {self.n + 1} of {self.total} ({name}){took}", force=True)
        self.n += 1

    def done(self) -> None:
        self.line.close(f"{self.what}: {self.n} runs done in {time.monotonic() - self.t0:.0f} s")


def _over_off(per: dict[str, list[float]], keys: tuple[str, ...]) -> dict[str, list[float]]:
    """Each variant's seconds per step over those of the "off" run of the same round."""
    return {k: [on / off for on, off in zip(per[k], per["off"], strict=True)] for k in keys}


def _replica_paths(base: Path, width: int, steps: int, pairs: int) -> dict[str, Any]:
    """DDP under --hot-recovery with a snapshot every step: the per-rank part of each
    snapshot to the buddy (replicas=1) or through the launcher's store (replicas=0), beside
    a run without snapshots, interleaved `pairs` times; median seconds per step and ratios."""
    worker = ["--steps", str(steps), "--save-every=100000", "--sleep=0"]
    variants = {
        "off": None,
        "store": {"enabled": True, "every_steps": 1, "replicas": 0},
        "buddy": {"enabled": True, "every_steps": 1, "replicas": 1},
    }
    per: dict[str, list[float]] = {k: [] for k in variants}
    progress = _Runs("replica paths", pairs * len(variants))
    for i in range(pairs):
        for name, snap in variants.items():
            progress.next(name)
            d = base / f"paths{i}-{name}"
            cmd = _cmd(d, width, 10.0, *worker)
            if snap is not None:
                cmd[4:4] = ["--hot-recovery"]
            _launch_to_end(d, cmd, snap or {"enabled": False})
            _, median = _per_step(d / "rec", SETTLED if steps >= 2 * SETTLED else 5)
            per[name].append(median)
    progress.done()
    ratio = _over_off(per, ("store", "buddy"))
    return {
        "median_step_s": {k: [round(x, 5) for x in v] for k, v in per.items()},
        "ratios": {k: [round(x, 4) for x in v] for k, v in ratio.items()},
        "store_overhead": round(statistics.median(ratio["store"]) - 1, 4),
        "buddy_overhead": round(statistics.median(ratio["buddy"]) - 1, 4),
    }


def _floor(step_dir: Path, procs: int, *extra: str) -> float:
    """Seconds from spawning `procs` bare processes to the last one having loaded the
    checkpoint (each loads all of it, as each DDP rank does)."""
    t0 = time.time()
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", FLOOR, str(step_dir), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=_env(),
        )
        for _ in range(procs)
    ]
    done = []
    for p in ps:
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"floor process failed with code {p.returncode}")
        done.append(float(out.split()[0]))
    return max(done) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, one kill (< 1 min)")
    ap.add_argument("--width", type=int, default=None, help="MLP width (checkpoint ~24*w^2 B)")
    ap.add_argument("--kills", type=int, default=None)
    ap.add_argument("--grace", type=float, default=None, help="grace period for the SIGTERM")
    ap.add_argument("--out", default=None, help="keep the run here (default: a temp dir)")
    ap.add_argument(
        "--overhead-only",
        type=int,
        default=0,
        metavar="PAIRS",
        help="only the snapshot overhead, PAIRS interleaved rounds (JSON last line)",
    )
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 instead of DDP: the kills (cold and hot, the replacement restored from its "
        "buddy's replica) and the overhead with replication; no in-place rollback (DDP only)",
    )
    ap.add_argument(
        "--replica-paths",
        type=int,
        default=0,
        metavar="PAIRS",
        help="only DDP's per-rank replica under --hot-recovery, to the buddy against through "
        "the store, PAIRS interleaved rounds (JSON last line)",
    )
    args = ap.parse_args()
    width = args.width or (512 if args.quick else 2048)
    kills = args.kills or (1 if args.quick else 3)
    grace = args.grace or (10.0 if args.quick else 30.0)
    base = Path(args.out or tempfile.mkdtemp(prefix="bench_recovery_"))
    base.mkdir(parents=True, exist_ok=True)
    if args.replica_paths:
        got = _replica_paths(base, width, 100, args.replica_paths)
        print(json.dumps({"bench": "replica_paths", "width": width, **got}))
        return
    if args.overhead_only:
        got = _snapshot_overhead(base, width, 100, args.overhead_only, args.fsdp)
        print(json.dumps({"bench": "snapshot_overhead", "width": width, **got}))
        return
    run_dir, rec, ckpt = base / "run", base / "rec", base / "ckpt"
    cmd = [
        sys.executable, "-m", "resilient.cli", "run",
        "--nproc-per-node=2",
        f"--run-dir={run_dir}",
        f"--checkpoint-url={ckpt}",
        f"--grace-period={grace}",
        "--restart-jitter=0",
        str(WORKER),
        f"--record={rec}",
        f"--width={width}",
        "--save-every=5",
        "--sync",
        "--sleep=0.05",
        "--agree=200",
        *(["--fsdp"] if args.fsdp else []),
    ]  # fmt: skip
    print(f"bench_recovery: width {width}, {kills} kill(s), grace {grace:g} s, in {base}")
    log = (base / "launcher.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    cycles: list[dict[str, Any]] = []
    sigterm: dict[str, Any] = {}
    try:
        for i in range(kills):
            c = _kill_cycle(run_dir, rec, ckpt, proc)
            cycles.append(c)
            print(f"kill -9 #{i + 1}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
        # SIGTERM to the launcher two steps past the newest checkpoint, in the current attempt
        _wait(lambda: len(_committed(ckpt)) > 0, 60, "a checkpoint", proc)
        newest = max(_committed(ckpt))
        attempt = max((r for r in _records(rec) if "t" in r), key=lambda r: r["t"])["attempt"]

        def current() -> list[dict[str, Any]]:
            return [r for r in _records(rec) if r.get("attempt") == attempt]

        _wait(lambda: any(r["step"] >= newest + 2 for r in current()), 60, "steps", proc)
        t_sig = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=grace + 60)
        t_exit = time.time()
        done = max(r["step"] for r in current()) + 1
        commit = _events(run_dir, "preempt.committed")
        exits = _events(run_dir, "preempt.exit")
        sigterm = {
            "grace_s": grace,
            "exit_code": code,
            "steps_done": done,
            "committed": max(_committed(ckpt)),
            "steps_lost": done - max(_committed(ckpt)),
            "commit_s": round(max(e["_t"] for e in commit) - t_sig, 3) if commit else None,
            "ranks_exited_s": round(max(e["_t"] for e in exits) - t_sig, 3) if exits else None,
            "launcher_exit_s": round(t_exit - t_sig, 3),
        }
        print("SIGTERM: " + ", ".join(f"{k} {v}" for k, v in sigterm.items()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    step_dir = ckpt / f"step_{max(_committed(ckpt)):09d}"
    size = sum(f.stat().st_size for f in step_dir.iterdir())
    floor1 = statistics.median(_floor(step_dir, 1) for _ in range(1 if args.quick else 3))
    floor2 = statistics.median(_floor(step_dir, 2) for _ in range(1 if args.quick else 3))
    floor_ddp = statistics.median(
        _floor(step_dir, 1, "dynamo") for _ in range(1 if args.quick else 3)
    )
    total = statistics.median(c["total_s"] for c in cycles)
    # hot path: in-place rollback of an exception, against its cold path, same model
    # (FSDP2: no rollback in place; the failing rank is replaced hot, against a cold restart)
    if args.fsdp:
        hot_ex = _hot_kill(base / "exception-hot", width, 12, fsdp=True, raise_at=True)
        cold_ex = _exception_recovery(base / "exception-cold", width, False, 12, "--fsdp")
    else:
        hot_ex = _exception_recovery(base / "exception-hot", width, True, 12)
        cold_ex = _exception_recovery(base / "exception-cold", width, False, 12)
    hot_kills = [_hot_kill(base / f"kill-hot-{i}", width, fsdp=args.fsdp) for i in range(kills)]
    hot = statistics.median(c["total_s"] for c in hot_kills)
    for i, c in enumerate(hot_kills):
        print(f"kill -9 #{i + 1}, hot: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    overhead = _snapshot_overhead(
        base, width, 30 if args.quick else 100, 1 if args.quick else 2, args.fsdp
    )
    print(f"exception, {'hot replacement' if args.fsdp else 'in-place rollback'}: {hot_ex}")
    print(f"exception, cold restart: {cold_ex}")
    print(f"snapshot overhead: {overhead}")
    agree = [r["agree_us"] for r in _records(rec) if "agree_us" in r]
    steps = [r["s"] for r in _records(rec) if "s" in r]
    print(
        f"floor: 1 process {floor1:.3f} s, 2 side by side {floor2:.3f} s, 1 process that also "
        f"imports torch._dynamo as DDP's constructor does {floor_ddp:.3f} s "
        f"(checkpoint {size / 1e6:.1f} MB)"
    )
    print(
        f"kill -9 to first step: median {total:.3f} s = {total / floor1:.2f} x the 1-process "
        f"floor, {total / floor2:.2f} x the 2-process floor (target <= 1.3)"
    )
    print(
        f"kill -9 to first step, hot: median {hot:.3f} s = {hot / total:.3f} x cold "
        f"(target <= 0.25), {hot / floor1:.3f} x the 1-process floor (target <= 0.5)"
    )
    if agree:
        print(
            f"preemption check (all_reduce MAX of a flag, 2 ranks, gloo): "
            f"{statistics.mean(agree):.0f} us per step; step compute median "
            f"{1e3 * statistics.median(steps):.1f} ms"
        )
    result = {
        "bench": "recovery",
        "quick": args.quick,
        "fsdp": args.fsdp,
        "checkpoint_mb": round(size / 1e6, 2),
        "kill9": cycles,
        "kill9_total_s": total,
        "floor_1proc_s": round(floor1, 3),
        "floor_2proc_s": round(floor2, 3),
        "floor_with_ddp_import_s": round(floor_ddp, 3),
        "ratio_vs_floor_with_ddp_import": round(total / floor_ddp, 3),
        "ratio_vs_floor": round(total / floor1, 3),
        "ratio_vs_2proc_floor": round(total / floor2, 3),
        "sigterm": sigterm,
        "agree_us": round(statistics.mean(agree), 1) if agree else None,
        "step_ms": round(1e3 * statistics.median(steps), 2) if steps else None,
        "kill9_hot": hot_kills,
        "kill9_hot_total_s": hot,
        "hot_over_cold": round(hot / total, 3),
        "hot_over_floor": round(hot / floor1, 3),
        "hot_steps_lost": max(c["steps_lost"] for c in hot_kills),
        "exception_hot": hot_ex,
        "exception_cold": cold_ex,
        "exception_hot_over_cold": round(hot_ex["total_s"] / cold_ex["total_s"], 3)
        if hot_ex and cold_ex
        else None,
        "exception_hot_over_floor": round(hot_ex["total_s"] / floor1, 3) if hot_ex else None,
        "snapshot_overhead": overhead["snapshot_overhead"],
        "snapshot_overhead_adaptive": overhead["snapshot_overhead_adaptive"],
        "snapshot_overhead_runs": overhead,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
