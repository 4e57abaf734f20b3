"""The Hugging Face Trainer with resilient against the Trainer's own resume, side by side.

    .venv/bin/python scripts/bench_hf.py [--repeats 3] [--steps 120] [--out bench-output/hf]

Both variants run recipes/train_hf.py on 2 CPU ranks under `resilient run` (the stock
Trainer with `--plain`, which resumes through `resume_from_checkpoint`), in alternation:
1. fault-free: wall time, and the time per step from the Trainer's own train_runtime;
2. rank 1 SIGKILLed at step 30 of the first attempt (10 steps after the checkpoint of step
   20; a callback of this script fires the kill, the same in both): wall time, and whether
   the final state's digest equals the fault-free run's.
The resume's cost is the faulty run's wall time minus the fault-free one's: the restart, the
reload, the steps replayed after the checkpoint and, for the stock Trainer, the batches it
skips to get back to its position. Medians of `--repeats` runs; the per-step overhead is
resilient's step time over the stock Trainer's.

The step time in two parts, from each fault-free run's step ends on rank 0 (`step_parts`): a
step away from saves, and what each save adds to the steps after it. Both are read within
one run, so a load that drifts between runs moves them less than the whole run's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "train_hf.py"
SAVE_EVERY = 20  # the recipe's --save-steps, passed explicitly
AFTER_SAVE = 8  # steps after a save that its cost may reach (an async save's ~250 ms)

# the recipe with a kill at an exact step: a TrainerCallback added by patching the stock
# Trainer's __init__, which resilient's Trainer calls too, so both get the same fault
# It also marks, on rank 0 of the restarted attempt, when its process started, when the
# Trainer began training and when its first step ended, and on rank 1 the kill: the resume's
# cost in three parts (`resume_parts`). With BENCH_STEP_TIMES, rank 0 writes each step's end
# there (`step_parts`).
_KILLING = textwrap.dedent(
    """\
    import json, os, runpy, signal, sys, time
    STEP_ENDS = {}
    def mark(what):
        with open(os.environ["BENCH_MARKS"], "a") as f:
            f.write(json.dumps({"mark": what, "t": time.time()}) + "\\n")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "1"
    if restarted and os.environ.get("RANK") == "0":
        mark("start")
    import transformers
    KILL_AT = int(os.environ["BENCH_KILL_AT"])

    class Kill(transformers.TrainerCallback):
        stepped = False
        def on_train_begin(self, args, state, control, **kw):
            if restarted and os.environ.get("RANK") == "0":
                mark("train_begin")
        def on_step_end(self, args, state, control, **kw):
            if os.environ.get("BENCH_STEP_TIMES") and os.environ.get("RANK") == "0":
                STEP_ENDS[state.global_step] = time.perf_counter()
            if restarted and os.environ.get("RANK") == "0" and not self.stepped:
                self.stepped = True
                mark("first_step")
            first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if first and state.global_step == KILL_AT and os.environ.get("RANK") == "1":
                mark("kill")
                os.kill(os.getpid(), signal.SIGKILL)
        def on_train_end(self, args, state, control, **kw):
            if STEP_ENDS:
                with open(os.environ["BENCH_STEP_TIMES"], "w") as f:
                    json.dump(STEP_ENDS, f)

    init = transformers.Trainer.__init__  # resilient's Trainer calls it too
    def patched(self, *a, **k):
        init(self, *a, **k)
        self.add_callback(Kill())
    transformers.Trainer.__init__ = patched
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def run(
    out: Path, *, plain: bool, kill_at: int | None, steps: int, samples: int, width: int = 32
) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the same shim for both runs of both variants: a fault-free run kills nothing
    shim = out / "killing.py"
    shim.write_text(_KILLING)
    env["BENCH_KILL_AT"] = str(kill_at if kill_at is not None else -1)
    env["BENCH_MARKS"] = str(out / "marks.jsonl")
    if kill_at is None:
        env["BENCH_STEP_TIMES"] = str(out / "step_ends.json")
    script = [str(shim), str(RECIPE)]
    cmd = [
        sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node=2",
        f"--run-dir={out / 'run'}", f"--checkpoint-url={out / 'ckpt'}",
        "--restart-backoff=0", "--restart-jitter=0",
        *script, f"--out={out}", f"--steps={steps}", f"--samples={samples}",
        f"--width={width}",
        f"--save-steps={SAVE_EVERY}", *(["--plain"] if plain else []),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    runtimes = re.findall(r"'train_runtime': '([0-9.]+)'", proc.stdout + proc.stderr)
    return {
        "wall_s": wall,
        "digest": (out / "digest.txt").read_text().split()[1],
        "step_s": float(runtimes[-1]) / steps if runtimes and kill_at is None else None,
        **(resume_parts(out / "marks.jsonl") if kill_at is not None else {}),
        **(step_parts(out / "step_ends.json", SAVE_EVERY) if kill_at is None else {}),
    }


def step_parts(step_ends: Path, save_every: int) -> dict[str, float]:
    """The step time in two parts, from one run's step ends on rank 0: `steady_ms`, the
    median step at least AFTER_SAVE steps past a save (the first save's period left out: the
    start, the loader's first batches); `save_ms`, what each save adds to the AFTER_SAVE steps
    after it, over that median (the mean over the saves whose steps all ran)."""
    ends = {int(k): v for k, v in json.loads(step_ends.read_text()).items()}
    step = {s: 1000 * (ends[s] - ends[s - 1]) for s in ends if s - 1 in ends and s > save_every}
    # step s began (s - 1) % save_every steps after the last save
    steady = statistics.median(ms for s, ms in step.items() if (s - 1) % save_every >= AFTER_SAVE)
    saves = [k for k in range(save_every, max(step), save_every) if k + AFTER_SAVE in step]
    added = [sum(step[k + i] - steady for i in range(1, AFTER_SAVE + 1)) for k in saves]
    return {"steady_ms": steady, "save_ms": statistics.mean(added) if added else math.nan}


def resume_parts(marks: Path) -> dict[str, float]:
    """The resume in three parts, from the marks of the killing shim: the kill to the new
    process (the launcher: the failure seen, the survivor stopped, a new round, the spawn),
    to the Trainer's start of training (imports, the model, the Trainer, and whatever the
    variant loads before training begins), to the end of the first step (what it loads or
    skips after, and the step)."""
    t = {m["mark"]: m["t"] for m in map(json.loads, marks.read_text().splitlines())}
    return {
        "launch_s": t["start"] - t["kill"],
        "setup_s": t["train_begin"] - t["start"],
        "first_step_s": t["first_step"] - t["train_begin"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-at", type=int, default=30)
    p.add_argument(
        "--samples", type=int, default=4096, help="dataset size: 4096 is 512 steps an epoch"
    )
    p.add_argument("--width", type=int, default=32, help="the model's width (n_embd)")
    p.add_argument("--out", type=Path, default=REPO / "bench-output" / "hf")
    a = p.parse_args()
    compare(
        lambda out, plain, kill: run(
            out, plain=plain, kill_at=kill, steps=a.steps, samples=a.samples, width=a.width
        ),
        repeats=a.repeats,
        out=a.out,
        kill_at=a.kill_at,
        title=f"{a.repeats} runs each, {a.steps} steps, width {a.width}, 2 CPU ranks, "
        f"kill -9 of rank 1 at step {a.kill_at} (checkpoint every 20):",
    )


def compare(
    run_one: Callable[[Path, bool, int | None], dict[str, object]],
    *,
    repeats: int,
    out: Path,
    kill_at: int,
    title: str,
) -> None:
    """Run the stock framework and resilient's, each fault-free and with the kill, interleaved
    `repeats` times (`run_one(out_dir, plain, kill_at)`: a row with wall_s, digest, step_s),
    and print the medians' table and the per-step ratio. Shared by bench_lightning.py."""
    rows: dict[str, list[dict[str, object]]] = {}
    for i in range(repeats):
        for name, plain in (("stock", True), ("resilient", False)):
            for kill in (None, kill_at):
                key = f"{name}/{'kill' if kill else 'clean'}"
                run_dir = out / f"{key.replace('/', '-')}-{i}"
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                rows.setdefault(key, []).append(run_one(run_dir, plain, kill))
                print(key, i, rows[key][-1], file=sys.stderr, flush=True)

    def med(key: str, field: str) -> float:
        return statistics.median(float(r[field]) for r in rows[key])  # type: ignore[arg-type]

    print(f"\n{title}")
    print(f"{'variant':<10} {'step ms':>8} {'clean s':>8} {'faulty s':>9} {'resume s':>9}  exact")
    for name in ("stock", "resilient"):
        clean, kill = rows[f"{name}/clean"], rows[f"{name}/kill"]
        exact = sum(k["digest"] == c["digest"] for k, c in zip(kill, clean, strict=True))
        cost = med(f"{name}/kill", "wall_s") - med(f"{name}/clean", "wall_s")
        print(
            f"{name:<10} {1000 * med(f'{name}/clean', 'step_s'):>8.1f} "
            f"{med(f'{name}/clean', 'wall_s'):>8.1f} {med(f'{name}/kill', 'wall_s'):>9.1f} "
            f"{cost:>9.1f}  {exact}/{len(kill)}"
        )
    ratio = med("resilient/clean", "step_s") / med("stock/clean", "step_s")
    print(f"per-step time, resilient / stock: {ratio:.3f}")
    if all("steady_ms" in r for k in ("stock/clean", "resilient/clean") for r in rows[k]):
        print("the step time in two parts (medians of the fault-free runs): a step away from "
              "saves, and what each save adds to the steps after it")  # fmt: skip
        print(f"{'variant':<10} {'steady ms':>10} {'per save ms':>12}")
        for name in ("stock", "resilient"):
            steady, save = med(f"{name}/clean", "steady_ms"), med(f"{name}/clean", "save_ms")
            print(f"{name:<10} {steady:>10.1f} {save:>12.0f}")
        steady_ratio = med("resilient/clean", "steady_ms") / med("stock/clean", "steady_ms")
        print(f"steady step, resilient / stock: {steady_ratio:.3f}")
    if all("launch_s" in r for k in ("stock/kill", "resilient/kill") for r in rows[k]):
        print("the resume in parts (medians, s): kill to new process, to training's begin, "
              "to the first step's end")  # fmt: skip
        for name in ("stock", "resilient"):
            parts = [med(f"{name}/kill", f) for f in ("launch_s", "setup_s", "first_step_s")]
            print(f"{name:<10} " + " ".join(f"{x:>8.2f}" for x in parts))


if __name__ == "__main__":
    main()
