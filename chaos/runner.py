"""Run a scenario against a real multi-process run and check the invariants.

Invariants (DESIGN.md):
  a. final model and optimizer state bitwise equal to the fault-free run (same seed, world)
  b. each restart resumes from the newest checkpoint valid at the fault, and checkpoints
     kept up (at most one interval plus one save in flight behind); steps lost reported
  c. no checkpoint that failed verification was ever loaded
  d. the run ended within its time bound
  e. no process of the run remains
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from chaos.procs import (
    REPO,
    Run,
    alive,
    descendants,
    events,
    latest_event,
    torchrun_cmd,
    wait_for,
)
from chaos.scenario import Fault, Scenario

__all__ = ["Result", "run_scenario"]

_STEP_LINE = re.compile(r"^step (\d+) loss", re.M)
_FILE_FAULTS = {"corrupt", "truncate", "delete"}


@dataclass(slots=True)
class Injected:
    kind: str
    rank: int
    pid: int
    wall_time: float
    corrupted_step: int | None = None
    corrupted_file: str | None = None
    save_in_flight: int | None = None


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


def _recipe_cmd(sc: Scenario, out: Path, max_restarts: int) -> list[str]:
    args = [
        "--steps",
        str(sc.steps),
        "--save-every",
        str(sc.save_every),
        "--log-every",
        "1",
        "--workers",
        str(sc.workers),
        "--seed",
        str(sc.seed),
        "--corpus-chars",
        str(sc.corpus_chars),
        "--batch-size",
        "8",
        "--ckpt-dir",
        str(out / "ckpt"),
        "--run-dir",
        str(out / "run"),
    ]
    return torchrun_cmd(
        REPO / "recipes" / sc.recipe, args, nproc=sc.nproc, max_restarts=max_restarts
    )


_ENV = {"PYTHONUNBUFFERED": "1"}


def golden(sc: Scenario, cache: Path) -> dict[str, Any]:
    """The fault-free run's digest and wall time, computed once per golden key."""
    out = cache / sc.golden_key()
    done = out / "golden.json"
    if done.exists():
        return dict(json.loads(done.read_text()))
    shutil.rmtree(out, ignore_errors=True)
    with Run(_recipe_cmd(sc, out, 0), log_path=out / "stdout.log", env=_ENV) as run:
        rc = run.wait(sc.timeout_s)
        if rc != 0:
            raise RuntimeError(f"golden run failed ({rc}): {run.output()[-2000:]}")
        wall = run.elapsed
    info = json.loads((out / "run" / "final_digest.json").read_text())
    info["wall_s"] = wall
    done.write_text(json.dumps(info))
    return dict(info)


def _printed_steps(text: str) -> list[int]:
    return [int(s) for s in _STEP_LINE.findall(text)]


def _attempts(run_dir: Path, rank: int) -> int:
    return sum(1 for e in events(run_dir, rank) if e.get("event") == "runtime.init")


def _newest_committed(ckpt: Path) -> Path | None:
    dirs = sorted(p for p in ckpt.glob("step_*") if (p / "manifest.json").exists())
    return dirs[-1] if dirs else None


def _damage(kind: str, ckpt_dir: Path) -> str:
    data = sorted(ckpt_dir.glob("__*.distcp"))[0]
    raw = data.read_bytes()
    if kind == "corrupt":
        b = bytearray(raw)
        b[len(b) // 2] ^= 0xFF
        data.write_bytes(bytes(b))
    elif kind == "truncate":
        data.write_bytes(raw[: len(raw) // 2])
    else:
        data.unlink()
    return data.name


def _inject(fault: Fault, sc: Scenario, out: Path, run: Run, attempt: int) -> Injected:
    run_dir = out / "run"
    wait_for(
        lambda: (
            max(_printed_steps(_since_attempt(run.output(), attempt)), default=-1) >= fault.at_step
        ),
        timeout=sc.timeout_s,
        what=f"step {fault.at_step}",
    )
    info: dict[str, Any] = {}
    if fault.kind in _FILE_FAULTS:
        newest = wait_for(
            lambda: _newest_committed(out / "ckpt"),
            timeout=sc.timeout_s,
            what="a committed checkpoint",
        )
        info["corrupted_file"] = _damage(fault.kind, newest)
        info["corrupted_step"] = int(newest.name.split("_")[1])
    if fault.kind == "kill_during_save":

        def saving() -> int | None:
            start = latest_event(
                run_dir, "ckpt.save.start", rank=fault.rank, where=lambda e: e["restart"] == attempt
            )
            if start is None:
                return None
            done = latest_event(
                run_dir,
                "ckpt.save.committed",
                rank=fault.rank,
                where=lambda e: e["restart"] == attempt and e["step"] == start["step"],
            )
            return None if done else int(start["step"])

        info["save_in_flight"] = wait_for(
            saving, timeout=sc.timeout_s, what="a save in flight", poll=0.005
        )
    victim = latest_event(
        run_dir, "runtime.init", rank=fault.rank, where=lambda e: e["restart"] == attempt
    )
    assert victim is not None, "no runtime.init event for the victim"
    os.kill(int(victim["pid"]), signal.SIGKILL)
    _record(run_dir, kind=fault.kind, target_rank=fault.rank, pid=int(victim["pid"]), **info)
    return Injected(
        kind=fault.kind, rank=fault.rank, pid=int(victim["pid"]), wall_time=time.time(), **info
    )


def _record(run_dir: Path, **fields: Any) -> None:
    """Append a chaos.fault event to the run's logs, where `resilient report` finds it."""
    ts = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    with (run_dir / "logs" / "chaos.jsonl").open("a") as f:
        f.write(json.dumps({"event": "chaos.fault", "ts": ts, **fields}) + "\n")


_ATTEMPT_MARK = "runtime.resume"


def _since_attempt(text: str, attempt: int) -> str:
    """stdout from the given attempt on (attempts are separated by rank 0's resume line)."""
    parts = text.split(_ATTEMPT_MARK)
    return _ATTEMPT_MARK.join(parts[attempt + 1 :]) if len(parts) > attempt + 1 else ""


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_scenario(sc: Scenario, out_root: Path, *, keep: bool = False) -> Result:
    """Run `sc` under `out_root/<name>`; the directory is removed on success unless `keep`."""
    gold = golden(sc, out_root / "golden")
    out = out_root / sc.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "scenario.toml").write_text(sc.to_toml())
    injected: list[Injected] = []
    failures: list[str] = []
    with Run(_recipe_cmd(sc, out, sc.max_restarts), log_path=out / "stdout.log", env=_ENV) as run:
        try:
            for attempt, fault in enumerate(sorted(sc.faults, key=lambda f: f.at_step)):
                wait_for(
                    lambda a=attempt, r=fault.rank: (
                        _attempts(out / "run", 0) > a and _attempts(out / "run", r) > a
                    ),
                    timeout=sc.timeout_s,
                    what=f"attempt {attempt}",
                )
                injected.append(_inject(fault, sc, out, run, attempt))
            rc = run.wait(max(1.0, sc.timeout_s - run.elapsed))
        except TimeoutError as e:
            rc = None
            failures.append(f"d: {e}")
        wall = run.elapsed
        time.sleep(0.5)  # let dataloader workers of a finished run exit
        # workers run in sessions of their own: look for the launcher's tree and every
        # worker pid the run logged, not just the launcher's process group
        worker_pids = {
            int(e["pid"]) for e in events(out / "run") if e.get("event") == "runtime.init"
        }
        survivors = [p for p in (*descendants(run.proc.pid), *worker_pids) if alive(p)]
        leftover = bool(survivors) or _group_alive(run.proc.pid)
    if rc not in (0, None):
        failures.append(f"run exited with {rc}")
    checks = _check(sc, out, gold, injected, wall, leftover, failures)
    result = Result(
        scenario=sc.name,
        ok=not failures,
        wall_s=round(wall, 2),
        golden_wall_s=round(float(gold["wall_s"]), 2),
        checks=checks,
        failures=failures,
        faults=[asdict(i) for i in injected],
        run_dir=str(out),
    )
    (out / "result.json").write_text(json.dumps(asdict(result), indent=1))
    if result.ok and not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def _check(
    sc: Scenario,
    out: Path,
    gold: dict[str, Any],
    injected: list[Injected],
    wall: float,
    leftover: bool,
    failures: list[str],
) -> dict[str, str]:
    checks: dict[str, str] = {}
    run_dir = out / "run"
    # a. bitwise equal to the golden run
    digest_file = run_dir / "final_digest.json"
    digest = json.loads(digest_file.read_text())["digest"] if digest_file.exists() else None
    checks["a_bitwise_equal"] = "pass" if digest == gold["digest"] else f"fail ({digest})"
    # b. per fault: the restart resumed from the newest checkpoint that was valid at the fault
    #    (b1), and checkpointing had kept up: at most one interval plus one save in flight
    #    behind (b2). Steps lost are reported; they follow from the two.
    steps = _printed_steps((out / "stdout.log").read_text(errors="replace"))
    resumes = [e for e in events(run_dir, 0) if e.get("event") == "runtime.resume"]
    commits = [
        (_epoch(e["ts"]), int(e["step"]))
        for e in events(run_dir, 0)
        if e.get("event") == "ckpt.save.committed"
    ]
    drops = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    lost: list[int | None] = []
    damaged: dict[int, float] = {}  # step -> when it was damaged
    for n, inj in enumerate(injected):
        if inj.corrupted_step is not None:
            damaged[inj.corrupted_step] = inj.wall_time
        if n >= len(drops) or n + 1 >= len(resumes):
            lost.append(None)
            failures.append(f"b: fault {n} ({inj.kind}) was not followed by a restart")
            continue
        completed = steps[drops[n] - 1] + 1  # rank 0 prints step k after finishing it
        resumed = int(resumes[n + 1]["step"])
        lost.append(completed - resumed)
        before = [(t, st) for t, st in commits if t <= inj.wall_time]
        newest = max((st for _, st in before), default=0)
        valid = [
            st for t, st in before if st not in damaged or t > damaged[st]
        ]  # re-saved after the damage
        newest_valid = max(valid, default=0)
        if resumed < newest_valid:
            failures.append(
                f"b1: fault {n} ({inj.kind}) resumed at {resumed}, older than the "
                f"newest valid checkpoint {newest_valid}"
            )
        if completed - newest > 2 * sc.save_every:
            failures.append(
                f"b2: fault {n} ({inj.kind}) at step {completed} with the newest "
                f"checkpoint at {newest}: more than 2 intervals behind"
            )
    checks["b_steps_lost"] = f"{lost} (interval {sc.save_every})"
    # c. nothing that failed verification was loaded
    loads = [e for e in events(run_dir, 0) if e.get("event") == "ckpt.load"]
    bad = {i.corrupted_step for i in injected if i.corrupted_step is not None}
    resaved = {
        e["step"]: e["ts"]
        for e in events(run_dir, 0)
        if e.get("event") == "ckpt.save.committed" and e["step"] in bad and e.get("restart", 0) > 0
    }
    loaded_bad = [
        e["step"]
        for e in loads
        if e["step"] in bad and not (e["step"] in resaved and resaved[e["step"]] < e["ts"])
    ]
    fallbacks = sum(1 for e in events(run_dir, 0) if e.get("event") == "ckpt.fallback")
    checks["c_no_corrupt_load"] = "pass" if not loaded_bad else f"fail (loaded {loaded_bad})"
    if loaded_bad:
        failures.append(f"c: loaded corrupted checkpoint(s) {loaded_bad}")
    if bad and fallbacks == 0:
        failures.append("c: a checkpoint was damaged but no fallback was logged")
    # d. within the time bound
    bound_s = min(sc.timeout_s, 2 * float(gold["wall_s"]) + 30 * len(sc.faults) + 30)
    checks["d_time"] = f"{wall:.1f} s (bound {bound_s:.0f} s)"
    if wall > bound_s:
        failures.append(f"d: took {wall:.1f} s > bound {bound_s:.0f} s")
    # e. nothing left behind
    checks["e_no_leftover"] = "fail" if leftover else "pass"
    if leftover:
        failures.append("e: processes of the run were still alive after it ended")
    if checks["a_bitwise_equal"] != "pass":
        failures.append(f"a: final digest {digest} != golden {gold['digest']}")
    return checks


def describe(result: Result) -> str:
    status = "PASS" if result.ok else "FAIL"
    lines = [
        f"{status} {result.scenario}: {result.wall_s:.1f} s "
        f"(fault-free {result.golden_wall_s:.1f} s)"
    ]
    lines += [f"    {k}: {v}" for k, v in result.checks.items()]
    if not result.ok:
        lines += [f"    ! {f}" for f in result.failures]
        lines.append(f"    reproduce: {sys.executable} -m chaos run {result.run_dir}/scenario.toml")
    return "\n".join(lines)
