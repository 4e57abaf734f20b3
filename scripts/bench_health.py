"""What the node health checks cost before a rendezvous round (resilient/health/).

    .venv/bin/python scripts/bench_health.py                 # ~20 s
    .venv/bin/python scripts/bench_health.py --user-cmd true # with a --health-check command

A committed checkpoint of `--mib` MiB (fp32 parameters of an nn.Linear stack, with AdamW
state) is written to a local directory by CheckpointManager in a child process, and a run
directory is given `--nproc` ranks' worker logs of `--log-lines` lines each, a snapshot.memory
event among them (so host_memory reads the logs, as after a restart of a long run). This
process then loads what the supervisor has loaded when it checks its node (torch and torch
elastic's agent) and calls check_node once cold (it imports the checkpoint package's manifest
reading on first use) and `--runs` (5) times more; the median of those is the number.

Each run is printed with its checks' seconds; the last line of stdout is one JSON object:
health_check_s_median, runs, cold_s, per_check_s (the median of each check over the runs).
Files go under `bench-output/health/` (git-ignored) unless `--dir`, and are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MIB = 1 << 20

_SAVE = """
import sys, torch
from torch import nn
from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
mib, url = int(sys.argv[1]), sys.argv[2]
width = 1024
layers = max(1, mib * (1 << 20) // (width * width * 4))
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, width)).sum().backward()
opt.step()
mgr = CheckpointManager(CheckpointConfig(url=url, async_save=False))
mgr.save(TrainState(model=model, optimizer=opt), step=100)
print(mgr.read_manifest(100).total_bytes)
mgr.close()
"""


def write_logs(run_dir: Path, nproc: int, lines: int) -> int:
    """Worker logs as resilient's event log writes them; their total bytes."""
    from resilient.log import EventLog

    for rank in range(nproc):
        log = EventLog(
            run_dir / "logs" / f"rank{rank}.jsonl",
            static={"run_id": "bench", "rank": rank, "restart": 0, "pid": 1},
            console_level="CRITICAL",
        )
        log.info("snapshot.memory", bytes_per_copy=64 * MIB, copies=2, total_bytes=128 * MIB)
        for i in range(lines):
            log.info("train.progress", first=i, last=i, t0=0.0, t1=0.1, busy_s=0.1)
        log.close()
    return sum(p.stat().st_size for p in (run_dir / "logs").glob("rank*.jsonl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mib", type=int, default=64, help="MiB of fp32 parameters checkpointed")
    p.add_argument("--nproc", type=int, default=8, help="nproc_per_node (and worker logs)")
    p.add_argument("--log-lines", type=int, default=20000, help="events per worker log")
    p.add_argument("--user-cmd", default=None, help="a --health-check command")
    p.add_argument("--dir", default=str(REPO / "bench-output" / "health"))
    args = p.parse_args()

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt, run_dir = work / "ckpt", work / "run"
    saved = subprocess.run(
        [sys.executable, "-c", _SAVE, str(args.mib), str(ckpt)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    ckpt_bytes = int(saved.stdout.strip().splitlines()[-1])
    log_bytes = write_logs(run_dir, args.nproc, args.log_lines)
    print(
        f"checkpoint step 100: {ckpt_bytes / MIB:.1f} MiB; worker logs: {args.nproc} x "
        f"{args.log_lines} events, {log_bytes / MIB:.1f} MiB"
    )

    import torch.distributed.elastic.agent.server.api  # noqa: F401  what the supervisor holds

    from resilient.health import HealthInputs, check_node
    from resilient.log import EventLog

    inputs = HealthInputs(
        run_dir=str(run_dir),
        checkpoint_url=str(ckpt),
        nproc_per_node=args.nproc,
        user_cmd=tuple(shlex.split(args.user_cmd)) if args.user_cmd else (),
    )
    log = EventLog(work / "supervisor.jsonl", console_level="CRITICAL")

    def once() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        report = check_node(inputs, log)
        took = time.perf_counter() - t0
        assert report.ok, report.summary()
        return took, {c.name: c.seconds for c in report.checks}

    cold, cold_checks = once()
    print(f"cold: {cold:.4f} s  " + "  ".join(f"{k}={v:.4f}" for k, v in cold_checks.items()))
    runs: list[float] = []
    per_check: dict[str, list[float]] = {}
    for i in range(args.runs):
        took, checks = once()
        runs.append(took)
        for k, v in checks.items():
            per_check.setdefault(k, []).append(v)
        print(f"run {i + 1}: {took:.4f} s  " + "  ".join(f"{k}={v:.4f}" for k, v in checks.items()))
    log.close()
    shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "health_check_s_median": round(statistics.median(runs), 4),
                "runs": [round(r, 4) for r in runs],
                "cold_s": round(cold, 4),
                "per_check_s": {k: round(statistics.median(v), 4) for k, v in per_check.items()},
                "checkpoint_mib": round(ckpt_bytes / MIB, 1),
                "log_mib": round(log_bytes / MIB, 1),
                "nproc_per_node": args.nproc,
                "user_cmd": args.user_cmd,
            }
        )
    )


if __name__ == "__main__":
    main()
