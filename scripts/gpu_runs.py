"""The GPU checks that are runs of their own under `resilient run`, each ending in one JSON file
for scripts/gpu_summary.py (run by scripts/gpu_check.sh):

    python scripts/gpu_runs.py hot --work DIR --json hot.json
    python scripts/gpu_runs.py hf --work DIR --json hf.json
    python scripts/gpu_runs.py lightning --work DIR --json lightning.json

hot: a hot replacement on one GPU. scripts/gpu_hot_worker.py on 2 ranks, both on cuda:0
(CUDA tensors over gloo), three runs one after the other: fault-free; under --hot-recovery
with snapshots every step, rank 1 SIGKILLed in the forward of step 13 (replaced warm, its
state from the survivor's snapshot of the CUDA state, the others keep their processes); and
the same kill without hot recovery (a cold restart from the newest checkpoint). Both faulty
runs must end on the fault-free digest; each one's wall time minus the fault-free one's is
what its recovery cost.

hf, lightning: recipes/train_hf.py and recipes/train_lightning.py under `resilient run` on
one rank, fault-free and SIGKILLed in the backward of step 27, both at once (they share the
GPU; only their bits are compared): the killed run restarts from its checkpoint and must end
on the fault-free digest. Both recipes turn on deterministic CUDA kernels themselves (the
Trainer's full_determinism, Lightning's deterministic=True), which a bitwise resume on a GPU
needs (docs/porting.md#gpu-determinism).

`--device cpu` runs the same on the CPU: a smoke test of this script where no GPU is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a file: chaos and resilient from this checkout

HOT_STEPS, HOT_KILL = 24, "kill@rank=1,step=13,phase=forward"
FRAMEWORK_KILL = "kill@rank=0,step=27,phase=backward"
RUN_TIMEOUT_S = 240.0
"""One run's limit; gpu_check.sh's step timeout is the real bound."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=["hot", "hf", "lightning"])
    p.add_argument("--work", type=Path, required=True, help="run directories go here")
    p.add_argument("--json", type=Path, required=True, help="the result")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return p.parse_args(argv)


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Any:
    """`cmd` started in a session of its own (chaos.procs.Run), with the chaos harness's
    environment: detection in seconds rather than the production defaults' minutes."""
    from chaos.launch import _CHAOS_ENV
    from chaos.procs import Run

    return Run(cmd, log_path=log, env={**_CHAOS_ENV, **(env or {})})


def finish(run: Any) -> dict[str, Any]:
    """Wait for a started run (its whole tree is killed at the end); exit code, wall time."""
    with run:
        try:
            rc: int | None = run.wait(RUN_TIMEOUT_S)
        except TimeoutError:
            rc = None
    return {"rc": rc, "wall_s": round(run.elapsed, 2), "log": str(run.log_path)}


def resilient_run(nproc: int, out: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "resilient.cli", "run", f"--nproc-per-node={nproc}"),
        *(f"--run-dir={out / 'run'}", f"--checkpoint-url={out / 'ckpt'}"),
        *("--restart-backoff=0", "--restart-jitter=0", "--monitor-interval=0.1", *flags),
    ]


def inject(fault: str | None) -> list[str]:
    return ["-m", "chaos.inject", "--fault", fault, "--"] if fault else []


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    from resilient.events import read_events

    return read_events(run_dir, name) if (run_dir / "logs").is_dir() else []


def transport(run_dir: Path) -> str:
    """The training group's backend and world, from rank 0's runtime.init."""
    inits = [e for e in events(run_dir, "runtime.init") if e.get("rank") == 0]
    if not inits:
        return "?"
    return f"{inits[0].get('backend')}, {inits[0].get('world_size')} rank(s)"


def digest_of(run_dir: Path) -> str | None:
    path = run_dir / "final_digest.json"
    return json.loads(path.read_text()).get("digest") if path.exists() else None


def hot(args: argparse.Namespace) -> dict[str, Any]:
    worker = [str(REPO / "scripts" / "gpu_hot_worker.py"), "--device", args.device]
    worker += ["--micro-batches", "--steps", str(HOT_STEPS), "--save-every", "4"]
    worker += ["--log-every", "1", "--corpus-chars", "20000"]
    snapshots = {"RESILIENT_SNAPSHOT": json.dumps({"enabled": True, "every_steps": 1})}
    plan = {
        "fault_free": ([], None, {}),
        "hot": (["--hot-recovery"], HOT_KILL, snapshots),
        "cold": ([], HOT_KILL, {}),
    }
    runs: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for name, (flags, fault, env) in plan.items():
        out = args.work / name
        dirs = ["--ckpt-dir", str(out / "ckpt"), "--run-dir", str(out / "run")]
        cmd = [*resilient_run(2, out, *flags), *inject(fault), *worker, *dirs]
        run = runs[name] = finish(start(cmd, out / "stdout.log", env))
        run["digest"] = digest_of(out / "run")
        run["attempts"] = len(events(out / "run", "attempt.start"))
        if run["rc"] != 0:
            failures.append(f"{name}: exit {run['rc']} (log {run['log']})")
    gold = runs["fault_free"]["digest"]
    for name in ("hot", "cold"):
        if runs[name]["digest"] != gold or gold is None:
            failures.append(f"{name}: digest {runs[name]['digest']} != fault-free {gold}")
    hot_dir = args.work / "hot" / "run"
    replaced = events(hot_dir, "recovery.hot.replace")
    formed = events(hot_dir, "recovery.hot.formed")
    if len(replaced) != 1 or runs["hot"]["attempts"] != 1 or events(hot_dir, "recovery.cold"):
        failures.append(
            f"hot: {len(replaced)} warm replacement(s) in {runs['hot']['attempts']} attempt(s), "
            "expected 1 in 1 (no cold restart)"
        )
    if runs["cold"]["attempts"] != 2:
        failures.append(f"cold: {runs['cold']['attempts']} attempt(s), expected 2")
    base = runs["fault_free"]["wall_s"]
    detect = [e["since_detect_s"] for e in formed if "since_detect_s" in e]
    moved = [e["transfer_s"] for e in formed if "transfer_s" in e]
    return {
        "check": "hot",
        "ok": not failures,
        "failures": failures,
        "device": args.device,
        "transport": transport(hot_dir),
        "figures": {
            "digest": (gold or "")[:16],
            "hot_extra_s": round(runs["hot"]["wall_s"] - base, 2),
            "cold_extra_s": round(runs["cold"]["wall_s"] - base, 2),
            "hot_since_detect_s": max(detect) if detect else None,
            "snapshot_transfer_s": max(moved) if moved else None,
            "resumed_step": formed[0].get("to_step") if formed else None,
        },
        "runs": runs,
    }


def framework(args: argparse.Namespace) -> dict[str, Any]:
    from chaos.procs import resumed_step

    name = args.check
    recipe = REPO / "recipes" / f"train_{name}.py"
    needs = ["transformers", "accelerate"] if name == "hf" else ["lightning", "transformers"]
    absent = [m for m in needs if importlib.util.find_spec(m) is None]
    result: dict[str, Any] = {"check": name, "device": args.device, "figures": {}}
    if absent:
        return {**result, "ok": True, "skipped": f"{', '.join(absent)} not installed"}
    source = recipe.read_text()
    script = ["--grad-accum=2"]
    if "--device" in source:
        script += ["--device", args.device]
    elif name == "lightning" and 'accelerator="cpu"' in source and args.device == "cuda":
        why = f"{recipe.name} pins accelerator='cpu' and has no --device option"
        return {**result, "ok": True, "skipped": why}
    started = {}
    for run_name, fault in (("fault_free", None), ("faulty", FRAMEWORK_KILL)):
        out = args.work / run_name
        cmd = [*resilient_run(1, out), *inject(fault), str(recipe)]
        started[run_name] = (start([*cmd, f"--out={out}", *script], out / "stdout.log"), out)
    runs: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for run_name, (run, out) in started.items():
        done = runs[run_name] = finish(run)
        # the step and digest of the final state; Lightning's counters too
        finals = [out / "digest.txt", out / "lightning.txt"]
        text = " ".join(f.read_text().strip() for f in finals if f.exists())
        done["digest"] = text or None
        done["resumed_step"] = resumed_step(out / "run")
        done["attempts"] = len(events(out / "run", "attempt.start"))
        if done["rc"] != 0:
            failures.append(f"{run_name}: exit {done['rc']} (log {done['log']})")
    gold, got = runs["fault_free"]["digest"], runs["faulty"]["digest"]
    if gold is None or got != gold:
        failures.append(f"faulty: digest {got} != fault-free {gold}")
    if runs["faulty"]["resumed_step"] is None:
        failures.append("faulty: no resume from a checkpoint")
    return {
        **result,
        "ok": not failures,
        "failures": failures,
        "transport": transport(args.work / "faulty" / "run"),
        "figures": {
            "digest": (gold or " ").split(" ")[1][:16],
            "steps": (gold or "").split(" ")[0],
            "resumed_step": runs["faulty"]["resumed_step"],
            "extra_s": round(runs["faulty"]["wall_s"] - runs["fault_free"]["wall_s"], 2),
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = hot(args) if args.check == "hot" else framework(args)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
