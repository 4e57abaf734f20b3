"""Run a scenario against a real multi-process run and check the invariants.

Every run goes through `resilient run` (torch elastic under the product's supervisor). A
preemption ends a launch with ExitCode.PREEMPTED; the runner then launches the same command
again, as a scheduler would on a new node, and the run must finish where it would have.

This module is the flow (`run_scenario`) and its result; the steps live in modules of their
own: chaos/plan.py (where faults land, the time bound), chaos/launch.py (command line,
environment, the fault-free golden run), chaos/external.py (faults sent from outside),
chaos/twohosts.py (the node-loss flow), chaos/observe.py (reading what a run did) and
chaos/check.py (the invariants, docs/internals.md#invariants as docs/chaos.md checks them).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos.check import _check
from chaos.external import Injected, _inject
from chaos.launch import (
    _HOT_ENV,
    _Env,
    _launch_cmd,
    golden,
    hot_recovery_unavailable,
    run_env,
)
from chaos.mesh import worlds
from chaos.netns import Hosts, netns_unavailable
from chaos.observe import _inits
from chaos.plan import plan
from chaos.procs import Run, alive, descendants
from chaos.scenario import IN_PROCESS, LOST_PROCESS, PREEMPTIONS, Scenario
from chaos.storage import LoopbackS3, SmallDisk, small_disk_unavailable
from chaos.twohosts import _two_hosts
from resilient.exitcodes import ExitCode
from resilient.proctree import group_alive

__all__ = ["Result", "describe", "run_scenario"]


@dataclass(slots=True)
class Result:
    scenario: str
    ok: bool
    wall_s: float
    golden_wall_s: float
    checks: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str = ""
    skipped: str | None = None
    hot: bool = False
    """Ran in hot mode (the soak's summary counts hot and cold runs apart)."""
    recipe: str = ""
    storage: str = ""
    save_every: int = 0


def run_scenario(sc: Scenario, out_root: Path, *, keep: bool = False) -> Result:
    """Run `sc` under `out_root/<name>`; the directory is removed on success unless `keep`."""
    needs_disk = any(f.kind == "disk_full" for f in sc.faults)
    why = small_disk_unavailable() if needs_disk else None
    if sc.hosts == 2:
        why = netns_unavailable()
    hot_recovery = False
    if sc.hot and not why:
        no_hot = hot_recovery_unavailable()
        hot_recovery = no_hot is None
        lost = sorted({f.kind for f in sc.faults} & LOST_PROCESS)
        if lost and no_hot:
            why = f"hot mode with {lost}: {no_hot}"
    if why:
        return Result(
            sc.name, ok=True, wall_s=0.0, golden_wall_s=0.0, skipped=why, hot=sc.hot,
            recipe=sc.recipe, storage=sc.storage, save_every=sc.save_every,
        )  # fmt: skip
    gold = golden(sc, out_root / "golden")
    out = out_root / sc.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "scenario.toml").write_text(sc.to_toml())
    planned = plan(sc)
    injected: list[Injected] = []
    failures: list[str] = []
    rcs: list[int | None] = []
    leftover: list[int] = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        env = _Env(sc, out, str(out / "ckpt"))
        proc_env = run_env(sc)  # the watchdog (scaled for a mesh), RESILIENT_NUMERIC
        if sc.hot:
            proc_env.update(_HOT_ENV)
        if sc.storage == "s3":
            env.s3 = stack.enter_context(LoopbackS3())
            env.ckpt_url = env.s3.url()
            proc_env.update(env.s3.env)
        if needs_disk:
            env.disk = stack.enter_context(SmallDisk(out / "ckpt"))
        if sc.hosts == 2:
            hosts = stack.enter_context(Hosts())
            rc = _two_hosts(env, hosts, planned, proc_env, injected, failures, leftover, started)
            rcs.append(rc)
            if rc not in (0, None):
                failures.append(f"host A's launch exited with {rc}, expected 0")
        relaunch = [p for p in planned if p.fault.kind in PREEMPTIONS or p.fault.kind == "resize"]
        launches = 0 if sc.hosts == 2 else 1 + len(relaunch)
        for launch in range(launches):
            here = [p for p in planned if p.launch == launch]
            in_process = [p for p in here if p.fault.kind in IN_PROCESS]
            cmd = _launch_cmd(
                sc,
                out,
                env.ckpt_url,
                sc.max_restarts,
                in_process,
                hot_recovery=hot_recovery,
                launch=launch,
            )
            log = out / "stdout.log"
            with Run(cmd, log_path=log, env=proc_env, append=True) as run:
                try:
                    for p in here:
                        injected.append(_inject(p, env, run))
                    rc = run.wait(max(1.0, sc.timeout_s - (time.monotonic() - started)))
                except TimeoutError as e:
                    rc = None
                    failures.append(f"d: {e}")
                    run.kill()  # (d) failed already; (e) asks whether the kill left anything
                time.sleep(0.5)  # let dataloader workers of a finished run exit
                # workers run in sessions of their own: look for the launcher's tree and every
                # worker pid the run logged, not just the launcher's process group
                ranks = range(max(worlds(sc)))
                pids = {int(e["pid"]) for r in ranks for e in _inits(env.run_dir, r)}
                leftover += [p for p in (*descendants(run.proc.pid), *pids) if alive(p)]
                if group_alive(run.proc.pid):
                    leftover.append(run.proc.pid)
            rcs.append(rc)
            # the last launch ends the run: 0, or NUMERICAL_FAULT (87) after a bad batch's stop
            expected = sc.expected_exit if launch == launches - 1 else int(ExitCode.PREEMPTED)
            if launch < len(relaunch) and relaunch[launch].fault.kind == "resize":
                expected = -9  # the harness SIGKILLed the launcher (chaos/external.py)
            if rc is None:
                break
            if rc != expected:
                failures.append(f"launch {launch} exited with {rc}, expected {expected}")
                break
    wall = time.monotonic() - started
    last_rc = rcs[-1] if rcs else None
    checks = _check(
        sc, out, gold, planned, injected, wall, bool(leftover), failures, exit_code=last_rc
    )
    result = Result(
        scenario=sc.name,
        ok=not failures,
        wall_s=round(wall, 2),
        golden_wall_s=round(float(gold["wall_s"]), 2),
        checks=checks,
        failures=failures,
        faults=[asdict(i) for i in injected],
        run_dir=str(out),
        hot=sc.hot,
        recipe=sc.recipe,
        storage=sc.storage,
        save_every=sc.save_every,
    )
    (out / "result.json").write_text(json.dumps(asdict(result), indent=1))
    if result.ok and not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def describe(result: Result) -> str:
    if result.skipped:
        return f"SKIP {result.scenario}: {result.skipped}"
    status = "PASS" if result.ok else "FAIL"
    lines = [
        f"{status} {result.scenario}{' (hot)' if result.hot else ''}: {result.wall_s:.1f} s "
        f"(fault-free {result.golden_wall_s:.1f} s)"
    ]
    lines += [f"    {k}: {v}" for k, v in result.checks.items()]
    if not result.ok:
        lines += [f"    ! {f}" for f in result.failures]
        run_dir = Path(result.run_dir)
        lines.append(
            f"    reproduce: {sys.executable} -m chaos --out {run_dir.parent / 'rerun'} "
            f"run {run_dir / 'scenario.toml'}"
        )
    return "\n".join(lines)
