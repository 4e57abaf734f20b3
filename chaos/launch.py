"""Launching a scenario's runs: the `resilient run` command line around the recipe, the
environment the harness gives every run, and the fault-free reference ("golden") run each
scenario is compared with, computed once per golden key.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.mesh import mesh_args, size
from chaos.plan import _WATCHDOG, Planned, watchdog_for
from chaos.procs import REPO, Run
from chaos.scenario import PREEMPTIONS, Scenario
from chaos.storage import LoopbackS3, SmallDisk
from resilient.envvars import ENV_NUMERIC, ENV_PREEMPT, ENV_SNAPSHOT, ENV_WATCHDOG

__all__ = [
    "_CHAOS_ENV",
    "_HOT_ENV",
    "_Env",
    "_launch_cmd",
    "golden",
    "hot_recovery_unavailable",
    "launch_shape",
    "numeric_env",
    "run_env",
]


_CHAOS_ENV = {
    "PYTHONUNBUFFERED": "1",
    # detection in seconds, not the production defaults' minutes: a hang or a stopped rank
    # must end its attempt well inside the scenario's time bound
    ENV_WATCHDOG: json.dumps(_WATCHDOG),
    # likewise the preemption agreement: by default about once a second, which is most of a
    # scenario's 24 steps of 40-150 ms, so one stop could overshoot the next fault's step
    ENV_PREEMPT: json.dumps({"check_interval_s": 0.1}),
}


_HOT_ENV = {
    # hot mode: a snapshot after every step, so a rollback loses at most the step it failed in
    ENV_SNAPSHOT: json.dumps({"enabled": True, "every_steps": 1}),
}

_HOT_FLAG = "--hot-recovery"
_hot_flag: list[bool] = []


def hot_recovery_unavailable() -> str | None:
    """None when `resilient run` has --hot-recovery (a warm replacement for a lost process),
    else why the lost-process scenarios of hot mode cannot run. Asked once per process."""
    if not _hot_flag:
        import subprocess

        out = subprocess.run(
            [sys.executable, "-m", "resilient.cli", "run", "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        _hot_flag.append(_HOT_FLAG in out.stdout)
    if _hot_flag[0]:
        return None
    return (
        f"`resilient run` has no {_HOT_FLAG} yet (issue 10 items 2-3): a lost process cannot "
        "be recovered hot"
    )


def _spec(p: Planned) -> str:
    """The chaos.inject spec that arms an in-process fault of a scenario."""
    f = p.fault
    kind, phase, extra, gen = f.kind, f.phase, "", str(p.generation)
    if kind == "raise_twice":  # fires again at the same step after the rollback
        # ...in the same process (DDP: rolled back in place), or in the warm replacement
        # of the next generation (FSDP2: no in-place agreement)
        kind, extra, gen = "raise", ",times=2", "any"
    elif kind == "kill_during_snapshot":
        kind, phase = "kill", "snapshot"
    elif kind == "kill_during_replication":
        kind, phase = "kill", "replicate"
    elif kind == "bad_batch":  # the data's fault: whenever the step runs, in every attempt
        extra, gen = ",restart=any", "any"
    if f.factor is not None:  # spike, bad_batch: the output's scale (chaos/faults.py)
        extra += f",factor={f.factor:g}"
    where = f"rank={f.rank},step={f.at_step},phase={phase}"
    if kind == "bad_batch":
        return f"--fault={kind}@{where},generation={gen}{extra}"
    return f"--fault={kind}@{where},restart={p.restart},generation={gen}{extra}"


@dataclass(slots=True)
class _Env:
    """What a scenario runs against: its output directory, storage and the live launch."""

    sc: Scenario
    out: Path
    ckpt_url: str
    s3: LoopbackS3 | None = None
    disk: SmallDisk | None = None

    @property
    def run_dir(self) -> Path:
        return self.out / "run"


def launch_shape(sc: Scenario, launch: int) -> tuple[int, dict[str, int]]:
    """(ranks per host, mesh) of the scenario's `launch`-th launch: a preemption or a resize
    ends a launch, and after a resize the next ones run on its mesh (chaos/mesh.py)."""
    nproc, mesh, n = sc.nproc, dict(sc.mesh), 0
    for f in sorted(sc.faults, key=lambda f: f.at_step):
        if n == launch:
            break
        if f.kind in PREEMPTIONS or f.kind == "resize":
            n += 1
            if f.mesh is not None:
                nproc, mesh = size(f.mesh), dict(f.mesh)
    return nproc, mesh


def _launch_cmd(
    sc: Scenario,
    out: Path,
    ckpt_url: str,
    max_restarts: int,
    in_process: list[Planned],
    rendezvous: list[str] | None = None,
    *,
    hot_recovery: bool = False,
    splits: list[tuple[int, int]] | None = None,
    launch: int = 0,
) -> list[str]:
    """`resilient run` (the product's supervisor on torch elastic) around the recipe, through
    `python -m chaos.inject` when in-process faults are armed for this launch. A mesh
    scenario's launch runs on its mesh (after a resize, the resize's), and every rank logs
    the samples of each step (--sample-log, chaos/mesh.py)."""
    nproc, mesh = launch_shape(sc, launch)
    recipe_args = [
        *("--steps", str(sc.steps), "--save-every", str(sc.save_every), "--log-every", "1"),
        *("--workers", str(sc.workers), "--seed", str(sc.seed)),
        *("--corpus-chars", str(sc.corpus_chars), "--batch-size", "8"),
        *("--ckpt-dir", ckpt_url, "--run-dir", str(out / "run")),
        *mesh_args(mesh),
        *(["--sample-log", str(out / "samples")] if mesh else []),
    ]
    if sc.hot:
        recipe_args.append("--micro-batches")
        if splits:  # the fault-free run: the splits the faulty run's OOM retries leave
            recipe_args += ["--splits", ",".join(f"{s}:{k}" for s, k in splits)]
    cmd = [
        sys.executable,
        "-m",
        "resilient.cli",
        "run",
        *(rendezvous or ["--standalone"]),
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        f"--run-dir={out / 'run'}",
        f"--grace-period={sc.grace_s:g}",
        "--restart-backoff=0.1",
        "--restart-jitter=0",
        f"--crash-loop-restarts={max_restarts + 1}",  # faults, not a crash loop
        *([_HOT_FLAG] if hot_recovery else []),
    ]
    script = str(REPO / "recipes" / sc.recipe)
    if not in_process:
        return [*cmd, script, *recipe_args]
    specs = [_spec(p) for p in in_process]
    return [*cmd, "-m", "chaos.inject", *specs, "--", script, *recipe_args]


_GOLDEN_LOCKS: dict[Path, threading.Lock] = {}


_GOLDEN_GUARD = threading.Lock()


def golden(sc: Scenario, cache: Path) -> dict[str, Any]:
    """The fault-free run's digest and wall time, computed once per golden key (scenarios
    may run side by side in threads: one computes it, the others wait)."""
    out = cache / sc.golden_key()
    with _GOLDEN_GUARD:
        lock = _GOLDEN_LOCKS.setdefault(out, threading.Lock())
    with lock:  # a two-host scenario compares with the same world on one host
        # numeric settings change no bits, but the steps the faulty run skips (skip-golden)
        skips = {"skip_steps": sc.skip_steps()} if sc.skip_steps() else {}
        clean = dataclasses.replace(
            sc, nproc=sc.nproc * sc.hosts, hosts=1, faults=[], numeric=skips
        )
        return _golden(clean, out, sc.splits())


def run_env(sc: Scenario) -> dict[str, str]:
    """The harness's environment for a run of `sc`: _CHAOS_ENV, the watchdog scaled for a
    mesh (chaos/plan.py), RESILIENT_NUMERIC."""
    return {**_CHAOS_ENV, ENV_WATCHDOG: json.dumps(watchdog_for(sc)), **numeric_env(sc)}


def numeric_env(sc: Scenario) -> dict[str, str]:
    """RESILIENT_NUMERIC for a run of `sc` (none when the scenario sets nothing)."""
    return {ENV_NUMERIC: json.dumps(sc.numeric)} if sc.numeric else {}


def _golden(sc: Scenario, out: Path, splits: list[tuple[int, int]]) -> dict[str, Any]:
    """The fault-free run; in hot mode with snapshots off, so equal bits also show that
    taking them changes nothing."""
    done = out / "golden.json"
    if done.exists():
        return dict(json.loads(done.read_text()))
    shutil.rmtree(out, ignore_errors=True)
    cmd = _launch_cmd(sc, out, str(out / "ckpt"), 0, [], splits=splits)
    env = run_env(sc)
    with Run(cmd, log_path=out / "stdout.log", env=env) as run:
        rc = run.wait(sc.timeout_s)
        if rc != 0:
            raise RuntimeError(f"golden run failed ({rc}): {run.output()[-2000:]}")
        wall = run.elapsed
    info = json.loads((out / "run" / "final_digest.json").read_text())
    info["wall_s"] = wall
    done.write_text(json.dumps(info))
    return dict(info)
