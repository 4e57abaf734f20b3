"""Numerical-fault benchmark (issue 27): what the checks cost, and how fast a fault is undone.

    .venv/bin/python scripts/bench_numeric.py            # a few minutes
    .venv/bin/python scripts/bench_numeric.py --quick    # about a minute

Part 1, overheads: launches itself under torchrun with 2 ranks. One DDP GPT of the recipes'
size, AdamW, fixed token batches; the step loop of resilient's NumericWatch (begin, forward,
backward, observe the loss, optimizer.step through the watch's pre-step hook, end of step)
in rounds, the variants' order rotated every round:
- off: no hook, no check (the bare step);
- again: the same once more, an A/A control: its ratio to off is the noise floor;
- nonfinite: the default check (one screen over the gradients, the loss; no message);
- spike: the same with spike detection on (its verdict rides DDP's gradient all-reduce).
Ratios are medians over rounds of (median step of the variant's block / off's, same round):
`*_side_by_side`. Their noise (the A/A line) is larger than the checks, so the figures
`nonfinite_overhead` and `spike_overhead` are the direct accounting: all the watch adds to a
step (begin, observe, the loss hook, the pre-step check on real gradients, end of step;
median of 300 (100 with --quick), both ranks in step, interleaved with the same bare
one-element backward, whose median is taken off) over off's step.
The replica check (sdc) is timed on its own (fingerprint of every parameter and the
all-gather, median of 20) and divided by its default interval (100 steps) of off's step.

Part 2, recovery: the DDP recipe under `python -m chaos.inject` with snapshots every step
and `--micro-batches`: an exception at step 6 (rolled back in place by the guard: the hot
rollback) and a NaN loss at step 14 (rolled back by the numeric check), in the same run.
For each: seconds from the fault to the end of the faulty step's replay (its
`step.fingerprint`). `numeric_recovery_over_rollback` is the NaN's over the exception's
(median over --runs runs; target <= 2).

Part 3, FSDP2's sampled re-run: the FSDP2 recipe with a re-run every 2nd step (snapshots
every step); a re-run costs its rollback (`rollback.done` seconds) plus the step once more;
`sdc_rerun_overhead` is that over 200 steps (the default `rerun_every`).

The last line of stdout is one JSON object with every figure.
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
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--runs", type=int, default=None, help="recovery runs (part 2)")
    p.add_argument("--out", default=None, help="(internal) part 1's result file")
    return p.parse_args()


# ----------------------------------------------------------------------------- part 1
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recipes.common.model import GPT, GPTConfig
    from resilient.numeric.config import NumericConfig
    from resilient.numeric.detect import NumericWatch
    from resilient.numeric.replicas import replicas_agree

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = SimpleNamespace(
        distributed=True, world_size=world, rank=rank, control_group=dist.new_group(backend="gloo")
    )
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0)
    model = DDP(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    batches = [
        torch.randint(cfg.vocab_size, (8, cfg.block_size + 1), generator=g) for _ in range(8)
    ]
    watches = {
        "nonfinite": NumericWatch(NumericConfig(), ctx),  # type: ignore[arg-type]
        "spike": NumericWatch(NumericConfig(spike_factor=10.0, spike_window=5), ctx),  # type: ignore[arg-type]
    }
    per_block = 10 if args.quick else 20
    rounds = args.rounds or (4 if args.quick else 10)
    step = [0]

    def block(variant: str) -> float:
        watch = watches.get(variant)
        hook = watch.attach(opt, replicated=True) if watch is not None else None
        times = []
        for _ in range(per_block):
            b = batches[step[0] % len(batches)]
            dist.barrier(group=ctx.control_group)  # both ranks start the step together
            t0 = time.perf_counter()
            if watch is not None:
                watch.begin(step[0])
            _, loss = model(b[:, :-1], b[:, 1:])
            if watch is not None:  # before backward, as the recipes do: its verdict rides it
                watch.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if watch is not None:
                assert watch.end_step() is None
            times.append(time.perf_counter() - t0)
            step[0] += 1
        if hook is not None:
            hook.remove()
        return statistics.median(times)

    variants = ["off", "again", "nonfinite", "spike"]
    for v in variants:  # warm-up
        block(v)
    ratios: dict[str, list[float]] = {v: [] for v in variants[1:]}
    off_steps = []
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        got = {v: block(v) for v in order}
        off_steps.append(got["off"])
        for v in variants[1:]:
            ratios[v].append(got[v] / got["off"])
    # direct accounting: all the watch adds to a step, on real gradients: begin, observe the
    # loss (its hook), the hook as the backward runs it, the pre-step check as the optimizer
    # runs it, end of step; over the same backward of a one-element graph with no watch
    b = batches[0]
    _, loss = model(b[:, :-1], b[:, 1:])
    loss.backward()
    base = loss.detach()

    def tiny_backward(watch: Any, i: int) -> float:
        leaf = base.clone().requires_grad_(True)
        root = leaf * 1.0
        dist.barrier(group=ctx.control_group)
        t0 = time.perf_counter()
        if watch is not None:
            watch.begin(10_000 + i)
            watch.observe_loss(root)
        root.backward()
        if watch is not None:
            watch._before_optimizer_step(opt, (), {})
            watch.end_step()
        return time.perf_counter() - t0

    for watch in watches.values():
        watch.attach(opt, replicated=True).remove()  # replicated, as the hook in a run sees it
    # interleaved, bare and each watch in turn, so that a drift of the machine's speed over
    # the samples lands on all of them alike
    samples: dict[str, list[float]] = {"bare": [], **{name: [] for name in watches}}
    for i in range(100 if args.quick else 300):
        for name in samples:
            samples[name].append(tiny_backward(watches.get(name), i))  # bare: no watch
    bare = statistics.median(samples["bare"])
    direct = {name: max(0.0, statistics.median(samples[name]) - bare) for name in watches}
    opt.zero_grad(set_to_none=True)
    checks = []
    for _ in range(20):
        dist.barrier(group=ctx.control_group)
        t0 = time.perf_counter()
        assert replicas_agree(model, ctx) is None  # type: ignore[arg-type]
        checks.append(time.perf_counter() - t0)
    step_s = statistics.median(off_steps)
    if rank == 0 and args.out:
        result = {
            "step_s": round(step_s, 6),
            "aa_overhead": round(statistics.median(ratios["again"]) - 1, 5),
            "nonfinite_side_by_side": round(statistics.median(ratios["nonfinite"]) - 1, 5),
            "spike_side_by_side": round(statistics.median(ratios["spike"]) - 1, 5),
            "nonfinite_check_s": round(direct["nonfinite"], 7),
            "spike_check_s": round(direct["spike"], 7),
            "nonfinite_overhead": round(direct["nonfinite"] / step_s, 5),
            "spike_overhead": round(direct["spike"] / step_s, 5),
            "sdc_check_s": round(statistics.median(checks), 6),
            "sdc_overhead": round(statistics.median(checks) / (100 * step_s), 5),
            "rounds": rounds,
            "steps_per_block": per_block,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def overheads(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "overheads.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, *sys.argv[1:], "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- part 2
def recovery_run(work: Path, i: int) -> dict[str, float]:
    run = work / f"run{i}"
    faults = ["raise@rank=1,step=6,phase=backward", "nan@rank=1,step=14,phase=forward"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--",
           str(REPO / "recipes" / "train_ddp.py"), "--steps", "20", "--save-every", "10",
           "--corpus-chars", "20000", "--batch-size", "8", "--micro-batches",
           "--ckpt-dir", str(run / "ckpt"), "--run-dir", str(run / "run")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "RESILIENT_SNAPSHOT": '{"enabled": true, '
           '"every_steps": 1}'}  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from resilient.events import read_events

    events = read_events(run / "run")
    faults_at = {
        int(e["step"]): float(e["time"]) for e in events if e.get("event") == "chaos.fault"
    }
    out = {}
    for name, step in (("exception", 6), ("nan", 14)):
        done = [  # the replayed step's end: its fingerprint, logged as the step closes
            _epoch(e["ts"])
            for e in events
            if e.get("event") == "step.fingerprint"
            and e.get("rank") == 0
            and int(e["step"]) == step
            and _epoch(e["ts"]) > faults_at[step]
        ]
        out[name] = min(done) - faults_at[step]
    return out


def rerun_cost(work: Path) -> dict[str, float]:
    """FSDP2's sampled re-run: the recipe with a re-run every 2nd step; each costs the
    rollback to the snapshot before the step plus the step once more."""
    run = work / "rerun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "recipes" / "train_fsdp.py"), "--steps", "24", "--save-every", "100",
           "--corpus-chars", "20000", "--batch-size", "8",
           "--ckpt-dir", str(run / "ckpt"), "--run-dir", str(run / "run")]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RESILIENT_SNAPSHOT": '{"enabled": true, "every_steps": 1}',
        "RESILIENT_NUMERIC": '{"rerun": true, "rerun_every": 2}',
    }
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from resilient.events import read_events

    events = [e for e in read_events(run / "run") if e.get("rank") == 0]
    restore = [float(e["seconds"]) for e in events if e.get("event") == "rollback.done"]
    steps = [
        (float(e["busy_s"]) / (int(e["last"]) - int(e["first"]) + 1))
        for e in events
        if e.get("event") == "train.progress"
    ]
    step_s = statistics.median(steps)
    per = statistics.median(restore) + step_s
    return {"rerun_restore_s": statistics.median(restore), "rerun_step_s": step_s,
            "reruns": len(restore), "sdc_rerun_overhead": per / (200 * step_s)}  # fmt: skip


def _epoch(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    parent = REPO / "bench-output"
    parent.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_numeric_", dir=parent))
    try:
        result = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    result = overheads(args, work)
    runs = args.runs or (2 if args.quick else 5)
    rec = [recovery_run(work, i) for i in range(runs)]
    result["rollback_exception_s"] = round(statistics.median(r["exception"] for r in rec), 4)
    result["rollback_nan_s"] = round(statistics.median(r["nan"] for r in rec), 4)
    result["numeric_recovery_over_rollback"] = round(
        statistics.median(r["nan"] / r["exception"] for r in rec), 3
    )
    result["recovery_runs"] = runs
    result.update({k: round(v, 6) for k, v in rerun_cost(work).items()})
    return result


if __name__ == "__main__":
    sys.exit(main())
