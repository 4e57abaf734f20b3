"""The demo: a real 2-rank DDP run, one rank killed with SIGKILL, resumed, proven bit-exact.

    python -m chaos.demo            (make demo does set-up first)

1. A fault-free run of recipes/train_ddp.py gives the reference state digest.
2. The same run under torchrun --max-restarts: once a checkpoint is committed and a few
   more steps have run, rank 1 gets SIGKILL. torchrun restarts the group, which resumes
   from the newest valid checkpoint and replays the lost steps.
3. Both final digests (sha256 over full model + optimizer state) must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

from chaos.procs import REPO, Run, latest_event, torchrun_cmd, wait_for

RECIPE = REPO / "recipes" / "train_ddp.py"


def _recipe_args(out: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--log-every",
        "1",
        "--ckpt-dir",
        str(out / "ckpt"),
        "--run-dir",
        str(out / "run"),
        "--workers",
        str(args.workers),
    ]


def _digest(out: Path) -> dict[str, object]:
    return json.loads((out / "run" / "final_digest.json").read_text())


def _last_step_printed(text: str) -> int | None:
    steps = re.findall(r"^step (\d+) loss", text, flags=re.M)
    return int(steps[-1]) if steps else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument(
        "--kill-after",
        type=int,
        default=40,
        help="kill once a checkpoint at or after this step is committed",
    )
    p.add_argument("--workers", type=int, default=1, help="dataloader workers per rank")
    p.add_argument("--out", type=Path, default=REPO / "demo-output")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    golden, faulty = args.out / "golden", args.out / "faulty"
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    print(
        f"[demo] 1/3 fault-free run: DDP GPT, 2 CPU ranks, {args.steps} steps, "
        f"checkpoint every {args.save_every}",
        flush=True,
    )
    with Run(
        torchrun_cmd(RECIPE, _recipe_args(golden, args)), log_path=golden / "stdout.log", env=env
    ) as run:
        rc = run.wait(args.timeout)
        if rc != 0:
            print(run.output()[-3000:])
            print(f"[demo] the fault-free run failed with exit code {rc}")
            return 1
        golden_s = run.elapsed

    print("[demo] 2/3 the same run with rank 1 killed by SIGKILL mid-run", flush=True)
    cmd = torchrun_cmd(RECIPE, _recipe_args(faulty, args), max_restarts=3)
    with Run(cmd, log_path=faulty / "stdout.log", env=env) as run:
        run_dir = faulty / "run"
        committed = wait_for(
            lambda: latest_event(
                run_dir, "ckpt.save.committed", rank=1, where=lambda e: e["step"] >= args.kill_after
            ),
            timeout=args.timeout,
            what=f"a checkpoint at step >= {args.kill_after}",
        )
        wait_for(
            lambda: (_last_step_printed(run.output()) or 0) >= committed["step"] + 7,
            timeout=args.timeout,
            what="a few steps past the checkpoint",
        )
        victim = latest_event(run_dir, "runtime.init", rank=1)
        assert victim is not None
        killed_at = _last_step_printed(run.output())
        os.kill(victim["pid"], signal.SIGKILL)
        print(
            f"[demo]     killed rank 1 (pid {victim['pid']}) at step {killed_at}; newest "
            f"committed checkpoint: step {committed['step']}",
            flush=True,
        )
        rc = run.wait(args.timeout)
        if rc != 0:
            print(run.output()[-3000:])
            print(f"[demo] the faulty run failed with exit code {rc}")
            return 1
        faulty_s = run.elapsed
    resumed = latest_event(run_dir, "runtime.resume", rank=0, where=lambda e: e["restart"] >= 1)
    if resumed is None:
        print("[demo] the run finished without a restart: the kill came too late to matter")
        return 1

    a, b = _digest(golden), _digest(faulty)
    same = a["digest"] == b["digest"]
    replayed = (killed_at or 0) - resumed["step"]
    print("[demo] 3/3 proof")
    print(f"  fault-free run : step {a['step']}  sha256 {a['digest']}  ({golden_s:.1f} s)")
    print(f"  faulty run     : step {b['step']}  sha256 {b['digest']}  ({faulty_s:.1f} s)")
    print(
        f"                   restarted once, resumed from step {resumed['step']}, "
        f"about {replayed} step(s) replayed"
    )
    print(f"  checkpoints    : {faulty / 'ckpt'}")
    print(f"  event logs     : {run_dir / 'logs'} (JSON lines per rank)")
    print(f"  RESULT         : {'IDENTICAL, bit for bit' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
