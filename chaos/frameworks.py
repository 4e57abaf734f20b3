"""Seeded faults in the framework recipes: the Hugging Face Trainer, Lightning and Accelerate
scripts of recipes/, each fault run compared bit for bit with a fault-free run of the same
script.

    python -m chaos.frameworks --out chaos-output/frameworks --seed 2026 --runs 30

Each draw picks a recipe (Trainer and Lightning twice as often as Accelerate), gradient
accumulation 1 or 2, FSDP2 for a third of the Lightning runs, `--hot-recovery` for a quarter
of the others (`--hot-fraction`), and one fault armed by chaos.inject at a random step, rank
and phase (kill -9, an exception, an OOM, a NaN once, a hang); in three runs of ten a second
fault follows in the restarted attempt. 60 steps (Accelerate: 40) over 32-step epochs, a
checkpoint every 20 (10): the faults land before and after saves, at epoch ends and inside
accumulations.

The checks: `resilient run` ends 0 within the run's timeout, the final state's digest (and
Lightning's counters: global step, epoch, logged step) equals the fault-free run's (one per
recipe, accumulation and FSDP setting), and no process of the run is left. A summary JSON
lists every draw and its outcome; the exit code is 1 when one failed. About 25 s a run on
two cores; `make soak` runs 30.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chaos.procs import REPO, Run, alive, kill_tree
from resilient.events import iter_events

RECIPES = {
    "hf": "train_hf.py",
    "lightning": "train_lightning.py",
    "accelerate": "train_accelerate.py",
}
DRAWN = ("hf", "hf", "lightning", "lightning", "accelerate")
KINDS = ("kill", "kill", "raise", "oom", "nan", "hang")
PHASES = ("data", "forward", "backward", "optimizer", "step")
# a hang is named after 4 s of no progress, not the learned timeouts' first-step minutes
WATCHDOG = '{"timeout_s": 4, "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3}'
TIMEOUT_S = 300.0


@dataclass
class Draw:
    recipe: str
    grad_accum: int
    fsdp: bool
    hot: bool
    faults: list[str]
    steps: int = field(init=False)

    def __post_init__(self) -> None:
        self.steps = 40 if self.recipe == "accelerate" else 60

    def golden_key(self) -> str:
        return f"{self.recipe}-ga{self.grad_accum}{'-fsdp' if self.fsdp else ''}"


def draw(rng: random.Random, hot_fraction: float = 0.25) -> Draw:
    recipe = rng.choice(DRAWN)
    fsdp = recipe == "lightning" and rng.random() < 1 / 3
    hot = not fsdp and rng.random() < hot_fraction
    steps = 40 if recipe == "accelerate" else 60
    step = rng.randrange(1, steps - 1)
    faults = [f"{rng.choice(KINDS)}@rank={rng.randrange(2)},step={step},phase={rng.choice(PHASES)}"]
    if rng.random() < 0.3:  # a second fault in the restarted attempt
        kind, at = rng.choice(("kill", "raise", "nan")), rng.randrange(step, steps - 1)
        phase = rng.choice(("forward", "backward", "optimizer"))
        faults.append(f"{kind}@rank={rng.randrange(2)},step={at},phase={phase},restart=1")
    return Draw(recipe, rng.choice((1, 2)), fsdp, hot, faults)


def command(d: Draw, out: Path, faults: list[str]) -> list[str]:
    script = [str(REPO / "recipes" / RECIPES[d.recipe]), f"--out={out}"]
    script += [f"--grad-accum={d.grad_accum}", f"--steps={d.steps}"]
    if d.recipe == "accelerate":
        script.append("--save-every=10")
    else:
        script += ["--save-steps=20", *(["--fsdp"] if d.fsdp else [])]
    inject = ["-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--"]
    return [
        sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node=2",
        f"--run-dir={out / 'run'}", f"--checkpoint-url={out / 'ckpt'}",
        "--restart-backoff=0", "--restart-jitter=0",
        *(["--hot-recovery"] if d.hot else []),
        *(inject if faults else []), *script,
    ]  # fmt: skip


def launch(cmd: list[str], out: Path) -> tuple[int | str, float, list[int]]:
    """Exit code (or "timeout"), seconds, and the run's processes still alive after it ended
    (none may be; they are killed)."""
    shutil.rmtree(out, ignore_errors=True)  # a former soak's checkpoints would be resumed
    out.mkdir(parents=True)
    with Run(cmd, log_path=out / "stdout.log", env={"RESILIENT_WATCHDOG": WATCHDOG}) as run:
        try:
            code: int | str = run.wait(TIMEOUT_S)
        except TimeoutError:
            code = "timeout"
        seconds = run.elapsed
    # a worker or spare is a session of its own: one that outlived its launcher is out of
    # the launcher's tree, so look for every pid the run's logs name
    left = [p for p in logged_pids(out / "run") if alive(p) and _ours(p)]
    for pid in left:
        kill_tree(pid)
    return code, seconds, left


def logged_pids(run_dir: Path) -> set[int]:
    """Every process the run's logs name: each event's `pid`, each attempt's `pids`."""
    pids: set[int] = set()
    for event in iter_events(run_dir):
        pids.update(p for p in [event.get("pid"), *event.get("pids", [])] if isinstance(p, int))
    return pids


def _ours(pid: int) -> bool:
    """The pid is still one of the runtime's processes (not reused by another)."""
    try:
        return b"resilient" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


_GOLDEN: dict[str, dict[str, str]] = {}
"""The fault-free finals this soak computed (never one of an earlier soak: the code may
have changed since)."""


def finals(out: Path) -> dict[str, str]:
    """What a run's script wrote at its end: the digest of its weights and optimizer, and
    the framework's own counters where the recipe writes them (Lightning's global step,
    epoch and logged step, in lightning.txt)."""
    return {f.name: f.read_text() for f in sorted(out.glob("*.txt"))}


def golden(d: Draw, root: Path) -> dict[str, str]:
    key = d.golden_key()
    if key not in _GOLDEN:
        out = root / f"golden-{key}"
        code, _, _ = launch(command(d, out, []), out)
        written = finals(out)
        if code != 0 or "digest.txt" not in written:
            raise RuntimeError(f"the fault-free run {out} failed ({code}): see its stdout.log")
        _GOLDEN[key] = written
    return _GOLDEN[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m chaos.frameworks", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("chaos-output/frameworks"))
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--hot-fraction", type=float, default=0.25, help="of the runs not on FSDP2")
    args = p.parse_args(argv)
    rng, results = random.Random(args.seed), []
    for i in range(args.runs):
        d = draw(rng, args.hot_fraction)
        expected = golden(d, args.out)
        out = args.out / f"seed{args.seed}-{i:03d}"
        code, seconds, left = launch(command(d, out, d.faults), out)
        exact = finals(out) == expected
        ok = code == 0 and exact and not left
        results.append({**asdict(d), "run": str(out), "exit": code, "exact": exact,
                        "left_behind": left, "seconds": round(seconds, 1), "ok": ok})  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    failed = [r["run"] for r in results if not r["ok"]]
    summary = {"seed": args.seed, "runs": len(results), "failed": failed, "results": results}
    (args.out / f"summary-{args.seed}.json").write_text(json.dumps(summary, indent=1))
    print(
        f"chaos.frameworks: {len(results) - len(failed)} of {len(results)} exact; failed: {failed}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
