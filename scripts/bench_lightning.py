"""Lightning with resilient against Lightning's own resume, side by side.

    .venv/bin/python scripts/bench_lightning.py [--repeats 3] [--steps 120] [--samples 4096]

Both variants run recipes/train_lightning.py on 2 CPU ranks under `resilient run` (stock
Lightning with `--plain`, which resumes through `fit(ckpt_path="last")`), in alternation:
1. fault-free: wall time, and the time per step measured inside the run from step 10 to the
   last (a callback of this script; startup, imports and the first steps left out);
2. rank 1 SIGKILLed at step 30 of the first attempt (10 steps after the checkpoint of step
   20; the same callback fires the kill, the same in both): wall time, and whether the final
   state's digest equals the fault-free run's.
The resume's cost is the faulty run's wall time minus the fault-free one's: the restart, the
reload and the steps replayed after the checkpoint. Medians of `--repeats` runs; the
per-step overhead is resilient's step time over stock Lightning's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench_hf import compare  # the interleaving and the table, shared

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "train_lightning.py"
TIMED_FROM = 10

# the recipe with a step timer and a kill at an exact step: a Callback added by patching
# lightning.Trainer.__init__, so both variants get the same one
_SHIM = textwrap.dedent(
    """\
    import os, runpy, signal, sys, time
    import lightning as L
    KILL_AT = int(os.environ.get("BENCH_KILL_AT", "0"))
    FROM = int(os.environ["BENCH_TIMED_FROM"])
    OUT = sys.argv[-1]

    class Bench(L.Callback):
        t0 = None
        def on_train_batch_end(self, trainer, *a):
            step, rank = trainer.global_step, os.environ.get("RANK")
            first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if first and KILL_AT and step == KILL_AT and rank == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            if step == FROM and self.t0 is None:
                self.t0 = time.perf_counter()
        def on_train_end(self, trainer, *a):
            if self.t0 is not None and trainer.global_rank == 0:
                per = (time.perf_counter() - self.t0) / (trainer.global_step - FROM)
                with open(os.path.join(OUT, "step_s.txt"), "w") as f:
                    f.write(str(per))

    init = L.Trainer.__init__
    def patched(self, *a, callbacks=None, **k):
        init(self, *a, callbacks=[*(callbacks or []), Bench()], **k)
    L.Trainer.__init__ = patched
    sys.argv = [sys.argv[1], *sys.argv[2:-1]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def run(
    out: Path, *, plain: bool, kill_at: int | None, steps: int, samples: int, width: int = 32
) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "BENCH_TIMED_FROM": str(TIMED_FROM)}
    shim = out / "bench_shim.py"
    shim.write_text(_SHIM)
    if kill_at is not None:
        env["BENCH_KILL_AT"] = str(kill_at)
    cmd = [
        sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node=2",
        f"--run-dir={out / 'run'}", f"--checkpoint-url={out / 'ckpt'}",
        "--restart-backoff=0", "--restart-jitter=0",
        str(shim), str(RECIPE), f"--out={out}", f"--steps={steps}", f"--samples={samples}",
        f"--width={width}",
        *(["--plain"] if plain else []), str(out),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    timed = out / "step_s.txt"
    return {
        "wall_s": wall,
        "digest": (out / "digest.txt").read_text().split()[1],
        "step_s": float(timed.read_text()) if kill_at is None and timed.exists() else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-at", type=int, default=30)
    p.add_argument(
        "--samples",
        type=int,
        default=4096,
        help="corpus size: 4096 is 512 steps an epoch, "
        "so the loader's start-up each epoch is amortised as in a real run",
    )
    p.add_argument("--width", type=int, default=32, help="the model's width (n_embd)")
    p.add_argument("--out", type=Path, default=REPO / "bench-output" / "pl")
    a = p.parse_args()
    compare(
        lambda out, plain, kill: run(
            out, plain=plain, kill_at=kill, steps=a.steps, samples=a.samples, width=a.width
        ),
        repeats=a.repeats,
        out=a.out,
        kill_at=a.kill_at,
        title=f"{a.repeats} runs each, {a.steps} steps, {a.samples} samples, width {a.width}, "
        "2 CPU ranks, "
        f"kill -9 of rank 1 at step {a.kill_at} (checkpoint every 20):",
    )


if __name__ == "__main__":
    main()
