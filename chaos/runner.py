"""Run a scenario against a real multi-process run and check the invariants.

Invariants (DESIGN.md):
  a. final model and optimizer state bitwise equal to the fault-free run (same seed, world)
  b. each restart resumes from the newest checkpoint valid at the fault, and checkpoints
     kept up (at most one interval plus one save in flight behind); steps lost reported;
     a preemption loses no step; a retried storage fault restarts nothing
  c. no checkpoint that failed verification was ever loaded
  d. the run ended within its time bound
  e. no process of the run remains

Every run goes through `resilient run` (torch elastic under the product's supervisor). A
preemption ends a launch with ExitCode.PREEMPTED; the runner then launches the same command
again, as a scheduler would on a new node, and the run must finish where it would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec

from chaos.netns import Hosts, netns_unavailable
from chaos.procs import REPO, Run, alive, descendants, events, latest_event, wait_for
from chaos.replay_check import check_replay
from chaos.scenario import IN_PROCESS, PREEMPTIONS, Fault, Scenario
from chaos.storage import LoopbackS3, SmallDisk, small_disk_unavailable
from resilient.events import read_events
from resilient.runtime.exitcodes import ExitCode
from resilient.runtime.heartbeat import ENV_WATCHDOG
from resilient.runtime.preempt import ENV_PREEMPT

__all__ = ["Result", "run_scenario"]

_STEP_LINE = re.compile(r"^step (\d+) loss", re.M)
_FILE_FAULTS = {"corrupt", "truncate", "delete"}


_WATCHDOG = {
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 5.0,
    "timeout_s": 10.0,
    "startup_timeout_s": 120.0,
    "checkpoint_timeout_s": 60.0,
}
_CHAOS_ENV = {
    "PYTHONUNBUFFERED": "1",
    # detection in seconds, not the production defaults' minutes: a hang or a stopped rank
    # must end its attempt well inside the scenario's time bound
    ENV_WATCHDOG: json.dumps(_WATCHDOG),
    # likewise the preemption agreement: by default about once a second, which is most of a
    # scenario's 24 steps of 40-150 ms, so one stop could overshoot the next fault's step
    ENV_PREEMPT: json.dumps({"check_interval_s": 0.1}),
}
_RESTART_ALLOWANCE_S = 60.0
"""Bound (d): a new attempt's start-up (interpreters, torch import, process groups, load)
and replay on a loaded 2-core machine, where start-up alone was seen to take 14 s."""


def _detect_bound_s(kind: str, sc: Scenario) -> float:
    """How long a fault of `kind` may take to end its attempt, from the timeouts in force."""
    beat = _WATCHDOG["heartbeat_interval_s"]
    if kind == "hang":  # a live rank past its phase timeout, then the exit grace
        return _WATCHDOG["timeout_s"] + 3 * beat + 1.0
    if kind in PREEMPTIONS:
        return sc.grace_s
    if kind in ("storage_errors", "storage_latency"):  # retried within the save's budget
        return 30.0
    # dead or stopped: a missing heartbeat (a peer's socket error is usually faster)
    return _WATCHDOG["heartbeat_timeout_s"] + 3 * beat + 1.0


def time_bound_s(sc: Scenario, golden_wall_s: float) -> float:
    """(d): twice the fault-free run, plus for each fault its detection bound and a restart."""
    per_fault = sum(_detect_bound_s(f.kind, sc) + _RESTART_ALLOWANCE_S for f in sc.faults)
    return min(sc.timeout_s, 2 * golden_wall_s + per_fault + 30.0)


@dataclass(slots=True)
class Planned:
    """Where a fault lands: launch (a preemption ends one), restart count within it, and the
    attempt overall (the n-th `runtime.init` of a rank)."""

    fault: Fault
    launch: int
    restart: int
    attempt: int


def plan(sc: Scenario) -> list[Planned]:
    out, launch, restart, attempt = [], 0, 0, 0
    for f in sorted(sc.faults, key=lambda f: f.at_step):
        out.append(Planned(f, launch, restart, attempt))
        if f.kind in PREEMPTIONS:
            launch, restart, attempt = launch + 1, 0, attempt + 1
        elif f.restarts:
            restart, attempt = restart + 1, attempt + 1
    return out


@dataclass(slots=True)
class Injected:
    kind: str
    rank: int
    pid: int
    wall_time: float
    attempt: int
    corrupted_step: int | None = None
    corrupted_file: str | None = None
    save_in_flight: int | None = None
    bit: int | None = None
    """Storage and disk faults: requests that got the fault, or saves that failed."""
    completed: int | None = None
    """node_loss: steps rank 0 had printed when the host was lost."""


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


def _launch_cmd(
    sc: Scenario,
    out: Path,
    ckpt_url: str,
    max_restarts: int,
    in_process: list[Planned],
    rendezvous: list[str] | None = None,
) -> list[str]:
    """`resilient run` (the product's supervisor on torch elastic) around the recipe, through
    `python -m chaos.inject` when in-process faults are armed for this launch."""
    recipe_args = [
        *("--steps", str(sc.steps), "--save-every", str(sc.save_every), "--log-every", "1"),
        *("--workers", str(sc.workers), "--seed", str(sc.seed)),
        *("--corpus-chars", str(sc.corpus_chars), "--batch-size", "8"),
        *("--ckpt-dir", ckpt_url, "--run-dir", str(out / "run")),
    ]
    cmd = [
        sys.executable,
        "-m",
        "resilient.cli",
        "run",
        *(rendezvous or ["--standalone"]),
        f"--nproc-per-node={sc.nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        f"--run-dir={out / 'run'}",
        f"--grace-period={sc.grace_s:g}",
        "--restart-backoff=0.1",
        "--restart-jitter=0",
        f"--crash-loop-restarts={max_restarts + 1}",  # faults, not a crash loop
    ]
    script = str(REPO / "recipes" / sc.recipe)
    if not in_process:
        return [*cmd, script, *recipe_args]
    specs = [
        f"--fault={p.fault.kind}@rank={p.fault.rank},step={p.fault.at_step},"
        f"phase={p.fault.phase},restart={p.restart}"
        for p in in_process
    ]
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
        return _golden(dataclasses.replace(sc, nproc=sc.nproc * sc.hosts, hosts=1, faults=[]), out)


def _golden(sc: Scenario, out: Path) -> dict[str, Any]:
    done = out / "golden.json"
    if done.exists():
        return dict(json.loads(done.read_text()))
    shutil.rmtree(out, ignore_errors=True)
    cmd = _launch_cmd(sc, out, str(out / "ckpt"), 0, [])
    with Run(cmd, log_path=out / "stdout.log", env=_CHAOS_ENV) as run:
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


def _inits(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The rank's `runtime.init` events, one per attempt, across launches, in order."""
    return [e for e in events(run_dir, rank) if e.get("event") == "runtime.init"]


def _ckpt_fs(env: _Env) -> tuple[fsspec.AbstractFileSystem, str]:
    """The checkpoint location as the harness sees it: the directory, or the bucket (read
    and damaged straight on the S3 server, not through the fault proxy)."""
    if env.s3 is not None:
        return env.s3.filesystem(), f"{env.s3.bucket}/ckpt"
    return fsspec.filesystem("file"), str(env.out / "ckpt")


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _newest_committed(fs: fsspec.AbstractFileSystem, root: str) -> str | None:
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return None
    dirs = sorted(
        p for p in entries if _name(p).startswith("step_") and fs.exists(f"{p}/manifest.json")
    )
    return dirs[-1] if dirs else None


def _damage(kind: str, fs: fsspec.AbstractFileSystem, ckpt_dir: str) -> str:
    data = sorted(
        p for p in fs.ls(ckpt_dir, detail=False) if fnmatch.fnmatch(_name(p), "__*.distcp")
    )[0]
    raw = fs.cat_file(data)
    if kind == "corrupt":
        b = bytearray(raw)
        b[len(b) // 2] ^= 0xFF
        fs.pipe_file(data, bytes(b))
    elif kind == "truncate":
        fs.pipe_file(data, raw[: len(raw) // 2])
    else:
        fs.rm_file(data)
    return _name(data)


def _chaos_records(run_dir: Path) -> list[dict[str, Any]]:
    return read_events(run_dir / "logs" / "chaos.jsonl")


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


def _inject(p: Planned, env: _Env, run: Run) -> Injected:
    fault, sc, run_dir = p.fault, env.sc, env.run_dir
    wait_for(
        lambda: min(len(_inits(run_dir, 0)), len(_inits(run_dir, fault.rank))) > p.attempt,
        timeout=sc.timeout_s,
        what=f"attempt {p.attempt}",
    )
    victim = _inits(run_dir, fault.rank)[p.attempt]
    pid = int(victim["pid"])
    base: dict[str, Any] = {
        "kind": fault.kind,
        "rank": fault.rank,
        "pid": pid,
        "attempt": p.attempt,
    }
    if fault.kind in IN_PROCESS:  # armed at launch: wait for the rank to report it fired
        n_before = sum(1 for q in plan(sc) if q.fault.kind in IN_PROCESS and q.attempt < p.attempt)
        rec = wait_for(
            lambda: ([r for r in _chaos_records(run_dir) if r.get("source") != "runner"] + [None])[
                n_before
            ],
            timeout=sc.timeout_s,
            what=f"{fault.kind} to fire at step {fault.at_step}",
        )
        return Injected(**base, wall_time=_epoch(rec["ts"]))
    wait_for(
        lambda: (
            max(_printed_steps(_since_attempt(run.output(), p.attempt)), default=-1)
            >= fault.at_step
        ),
        timeout=sc.timeout_s,
        what=f"step {fault.at_step}",
    )
    info: dict[str, Any] = {}
    if fault.kind in _FILE_FAULTS:
        fs, root = _ckpt_fs(env)
        newest = wait_for(
            lambda: _newest_committed(fs, root),
            timeout=sc.timeout_s,
            what="a committed checkpoint",
        )
        info["corrupted_file"] = _damage(fault.kind, fs, newest)
        info["corrupted_step"] = int(_name(newest).split("_")[1])
    if fault.kind == "kill_during_save":

        def saving() -> int | None:
            start = latest_event(run_dir, "ckpt.save.start", fault.rank, lambda e: e["pid"] == pid)
            if start is None:
                return None
            done = latest_event(
                run_dir,
                "ckpt.save.committed",
                fault.rank,
                lambda e: e["pid"] == pid and e["step"] == start["step"],
            )
            return None if done else int(start["step"])

        info["save_in_flight"] = wait_for(
            saving, timeout=sc.timeout_s, what="a save in flight", poll=0.005
        )
    t = time.time()
    if fault.kind in ("storage_errors", "storage_latency"):
        assert env.s3 is not None and env.s3.proxy is not None
        kind = "slowdown" if fault.kind == "storage_errors" else "delay"
        scheduled = env.s3.proxy.add(kind, method="PUT", times=fault.count, delay_s=fault.seconds)
        # the next save meets it; wait until it has been met in full
        wait_for(
            lambda: scheduled.fired >= fault.count,
            timeout=sc.timeout_s,
            what=f"{fault.count} requests to meet {kind}",
        )
        info["bit"] = scheduled.fired
    elif fault.kind == "disk_full":
        assert env.disk is not None
        env.disk.fill()
        try:
            failed = wait_for(
                lambda: latest_event(
                    run_dir, "ckpt.save.failed", None, lambda e: _epoch(e["ts"]) >= t
                ),
                timeout=sc.timeout_s,
                what="a save to fail on the full disk",
            )
        finally:
            env.disk.free()  # the operator frees space; the next attempt must save again
        info["bit"] = int(failed["step"])
    elif fault.kind == "sigterm":
        os.kill(run.proc.pid, signal.SIGTERM)
    else:
        sig = {"sigstop": signal.SIGSTOP, "sigterm_rank": signal.SIGTERM}.get(
            fault.kind, signal.SIGKILL
        )
        os.kill(pid, sig)
    _record(run_dir, kind=fault.kind, target_rank=fault.rank, pid=pid, t=t, **info)
    return Injected(**base, wall_time=t, **info)


def _record(run_dir: Path, *, t: float, **fields: Any) -> None:
    """Append a chaos.fault event to the run's logs, where `resilient report` finds it."""
    ts = datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
    with (run_dir / "logs" / "chaos.jsonl").open("a") as f:
        f.write(json.dumps({"event": "chaos.fault", "ts": ts, "source": "runner", **fields}) + "\n")


_ATTEMPT_MARK = "runtime.resume"


def _since_attempt(text: str, attempt: int) -> str:
    """stdout from the given attempt on (attempts are separated by rank 0's resume line)."""
    parts = text.split(_ATTEMPT_MARK)
    return _ATTEMPT_MARK.join(parts[attempt + 1 :]) if len(parts) > attempt + 1 else ""


def _attempt_steps(text: str) -> list[list[int]]:
    """The steps rank 0 printed, per attempt."""
    return [_printed_steps(part) for part in text.split(_ATTEMPT_MARK)[1:]]


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _two_hosts(
    env: _Env,
    hosts: Hosts,
    planned: list[Planned],
    proc_env: dict[str, str],
    injected: list[Injected],
    failures: list[str],
    leftover: list[int],
    started: float,
) -> int | None:
    """Host A (rendezvous host) and host B, `sc.nproc` workers each, --nnodes 1:2. At the
    fault every process of host B is killed; A's group restarts alone from the newest
    checkpoint (resharded) and must finish the run."""
    sc, out = env.sc, env.out

    def launch(i: int) -> Run:
        rendezvous = [
            "--nnodes=1:2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={hosts.addr[0]}:29400",  # each namespace has its own ports
            f"--rdzv-id={sc.name}",
            f"--rdzv-conf=is_host={int(i == 0)},last_call_timeout=1,keep_alive_interval=1,"
            "keep_alive_max_attempt=3,join_timeout=120",
            f"--local-addr={hosts.addr[i]}",
        ]
        cmd = _launch_cmd(sc, out, env.ckpt_url, sc.max_restarts, [], rendezvous)
        log = out / ("stdout.log" if i == 0 else "stdout-B.log")
        return Run([*hosts.exec_prefix(i), *cmd], log_path=log, env=proc_env)

    def printed() -> int:
        logs = [out / "stdout.log", out / "stdout-B.log"]
        text = "".join(p.read_text(errors="replace") for p in logs if p.exists())
        return max(_printed_steps(text), default=-1)

    with launch(1) as b:  # B waits for A's rendezvous store, so both join the first round
        time.sleep(0.5)
        with launch(0) as a:
            rc: int | None = None
            try:
                (p,) = planned
                wait_for(
                    lambda: printed() >= p.fault.at_step,
                    timeout=sc.timeout_s,
                    what=f"step {p.fault.at_step} on two hosts",
                )
                victim = _inits(env.run_dir, p.fault.rank)[0]
                completed = printed() + 1
                t = time.time()
                hosts.kill(1)
                _record(env.run_dir, kind="node_loss", target_rank=p.fault.rank, host=1, t=t)
                injected.append(
                    Injected(
                        kind="node_loss",
                        rank=p.fault.rank,
                        pid=int(victim["pid"]),
                        wall_time=t,
                        attempt=0,
                        completed=completed,
                    )
                )
                rc = a.wait(max(1.0, sc.timeout_s - (time.monotonic() - started)))
            except TimeoutError as e:
                failures.append(f"d: {e}")
                a.kill()
            time.sleep(0.5)
            pids = {int(e["pid"]) for r in range(2 * sc.nproc) for e in _inits(env.run_dir, r)}
            leftover += [q for q in (*descendants(a.proc.pid), *pids) if alive(q)]
            leftover += [q for i in range(2) for q in hosts.pids(i) if q not in (a.proc.pid,)]
            b.proc.poll()
    return rc


def run_scenario(sc: Scenario, out_root: Path, *, keep: bool = False) -> Result:
    """Run `sc` under `out_root/<name>`; the directory is removed on success unless `keep`."""
    needs_disk = any(f.kind == "disk_full" for f in sc.faults)
    why = small_disk_unavailable() if needs_disk else None
    if sc.hosts == 2:
        why = netns_unavailable()
    if why:
        return Result(sc.name, ok=True, wall_s=0.0, golden_wall_s=0.0, skipped=why)
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
        proc_env = dict(_CHAOS_ENV)
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
        preemptions = sum(1 for p in planned if p.fault.kind in PREEMPTIONS)
        launches = 0 if sc.hosts == 2 else 1 + preemptions
        for launch in range(launches):
            here = [p for p in planned if p.launch == launch]
            in_process = [p for p in here if p.fault.kind in IN_PROCESS]
            cmd = _launch_cmd(sc, out, env.ckpt_url, sc.max_restarts, in_process)
            log = out / "stdout.log"
            with Run(cmd, log_path=log, env=proc_env, append=True) as run:
                try:
                    for p in here:
                        injected.append(_inject(p, env, run))
                    rc: int | None = run.wait(max(1.0, sc.timeout_s - (time.monotonic() - started)))
                except TimeoutError as e:
                    rc = None
                    failures.append(f"d: {e}")
                    run.kill()  # (d) failed already; (e) asks whether the kill left anything
                time.sleep(0.5)  # let dataloader workers of a finished run exit
                # workers run in sessions of their own: look for the launcher's tree and every
                # worker pid the run logged, not just the launcher's process group
                pids = {int(e["pid"]) for r in range(sc.nproc) for e in _inits(env.run_dir, r)}
                leftover += [p for p in (*descendants(run.proc.pid), *pids) if alive(p)]
                if _group_alive(run.proc.pid):
                    leftover.append(run.proc.pid)
            rcs.append(rc)
            expected = 0 if launch == launches - 1 else int(ExitCode.PREEMPTED)
            if rc is None:
                break
            if rc != expected:
                failures.append(f"launch {launch} exited with {rc}, expected {expected}")
                break
    wall = time.monotonic() - started
    checks = _check(sc, out, gold, planned, injected, wall, bool(leftover), failures)
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
    planned: list[Planned],
    injected: list[Injected],
    wall: float,
    leftover: bool,
    failures: list[str],
) -> dict[str, str]:
    checks: dict[str, str] = {}
    run_dir = out / "run"
    # a. bitwise equal to the golden run
    digest_file = run_dir / "final_digest.json"
    final = json.loads(digest_file.read_text()) if digest_file.exists() else {}
    digest = final.get("digest")
    checks["a_bitwise_equal"] = "pass" if digest == gold["digest"] else f"fail ({digest})"
    if sc.hosts == 2:  # the world shrank: float sums differ by design; the run must finish
        shrunk = sc.nproc * (sc.hosts - 1)
        ok = final.get("step") == sc.steps and final.get("world_size") == shrunk
        checks["a_bitwise_equal"] = f"n/a (world {sc.nproc * sc.hosts} -> {shrunk}); finished: " + (
            "pass" if ok else f"fail ({final})"
        )
        if not ok:
            failures.append(f"a: the shrunk run did not finish at step {sc.steps}: {final}")
    # b. per fault: the restart resumed from the newest checkpoint that was valid at the fault
    #    (b1), and checkpointing had kept up: at most one interval plus one save in flight
    #    behind (b2); a preemption whose save fits the grace loses nothing (b3). Storage
    #    faults that are retried inside the save must not restart anything (b4).
    stdout = out / "stdout.log"
    steps = _attempt_steps(stdout.read_text(errors="replace") if stdout.exists() else "")
    rank0 = list(events(run_dir, 0))  # read once: every check below looks at rank 0's log
    resumes = [int(e["step"]) for e in rank0 if e.get("event") == "runtime.resume"]
    attempts = len(_inits(run_dir, 0))
    expected_attempts = 1 + sum(1 for p in planned if p.fault.restarts)
    if len(injected) == len(planned) and attempts != expected_attempts:
        failures.append(f"b4: {attempts} attempts, expected {expected_attempts}")
    commits = [
        (_epoch(e["ts"]), int(e["step"])) for e in rank0 if e.get("event") == "ckpt.save.committed"
    ]
    lost: list[int | None] = []
    damaged: dict[int, float] = {}  # step -> when it was damaged
    why: list[str] = []
    for p, inj in zip(planned, injected, strict=False):
        if inj.corrupted_step is not None:
            damaged[inj.corrupted_step] = inj.wall_time
        if inj.kind in ("storage_errors", "storage_latency", "disk_full") and not inj.bit:
            failures.append(f"b: {inj.kind} never reached the storage")
        if not p.fault.restarts:
            lost.append(0)
            continue
        k = p.attempt
        if k + 1 >= len(resumes) or (inj.completed is None and k >= len(steps)):
            lost.append(None)
            failures.append(f"b: fault at attempt {k} ({inj.kind}) was not followed by a restart")
            continue
        if inj.completed is not None:  # node_loss: rank 0's console may have been on host B
            completed = inj.completed
        else:  # rank 0 prints a step when it is done
            completed = max(steps[k], default=resumes[k] - 1) + 1
        resumed = resumes[k + 1]
        lost.append(completed - resumed)
        before = [(t, st) for t, st in commits if t <= inj.wall_time]
        newest = max((st for _, st in before), default=0)
        valid = [st for t, st in before if st not in damaged or t > damaged[st]]  # re-saved
        newest_valid = max(valid, default=0)
        if inj.kind in PREEMPTIONS:
            if completed != resumed:
                failures.append(
                    f"b3: preemption ({inj.kind}) lost {completed - resumed} steps "
                    f"(stopped after {completed}, resumed at {resumed})"
                )
            continue
        if resumed < newest_valid:
            failures.append(
                f"b1: fault at attempt {k} ({inj.kind}) resumed at {resumed}, older than the "
                f"newest valid checkpoint {newest_valid}"
            )
        # the last save due before the fault; if it had committed intact, the fault may cost
        # less than one interval; if it was still in flight (async) or the fault damaged it,
        # the previous one is what there is
        due = completed // sc.save_every * sc.save_every
        if due in valid and completed - resumed > sc.save_every:
            failures.append(
                f"b0: fault at attempt {k} ({inj.kind}) lost {completed - resumed} steps with "
                f"step {due} committed intact: more than the interval {sc.save_every}"
            )
        if completed - newest > 2 * sc.save_every:
            failures.append(
                f"b2: fault at attempt {k} ({inj.kind}) at step {completed} with the newest "
                f"checkpoint at {newest}: more than 2 intervals behind"
            )
        if due and due not in valid:
            why.append(f"{inj.kind}: save {due} " + ("damaged" if due in damaged else "in flight"))
    checks["b_steps_lost"] = f"{lost} (interval {sc.save_every})" + (
        f"; over one interval allowed: {', '.join(why)}" if why else ""
    )
    # c. nothing that failed verification was loaded
    # A load of step S is bad when it came after S was damaged and before S was saved
    # again; a load of S before the damage read it intact.
    loads = [(_epoch(e["ts"]), int(e["step"])) for e in rank0 if e.get("event") == "ckpt.load"]
    damaged_at = {i.corrupted_step: i.wall_time for i in injected if i.corrupted_step is not None}
    loaded_bad = [
        st
        for t, st in loads
        if st in damaged_at
        and t > damaged_at[st]
        and not any(damaged_at[st] < tc < t for tc, resaved in commits if resaved == st)
    ]
    checks["c_no_corrupt_load"] = "pass" if not loaded_bad else f"fail (loaded {loaded_bad})"
    if loaded_bad:
        failures.append(f"c: loaded corrupted checkpoint(s) {loaded_bad}")
    # The damage must have been noticed where it mattered: when the first load after it (a
    # fresh start counts as step 0) came from an older step, the runtime rejected the damaged
    # one and said so. The harness damages the newest commit it sees; a newer one can land
    # between its listing and the kill, and is then loaded intact with no fallback needed.
    fallback_at = [_epoch(e["ts"]) for e in rank0 if e.get("event") == "ckpt.fallback"]
    fresh = [(_epoch(e["ts"]), 0) for e in rank0 if e.get("event") == "ckpt.fresh_start"]
    loads_or_fresh = sorted(loads + fresh)
    for st, td in damaged_at.items():
        first = next(((t, ld) for t, ld in loads_or_fresh if t > td), None)
        if (
            first is not None
            and first[1] < st
            and not any(td < tf <= first[0] for tf in fallback_at)
        ):
            failures.append(
                f"c: step {st} was damaged and the restart loaded {first[1]}, but no fallback "
                "was logged"
            )
    # f. replayed steps equal the steps they replay (chaos/replay_check.py)
    checks["f_replay"], replay_failures = check_replay(run_dir)
    failures += replay_failures
    # d. within the time bound
    bound_s = time_bound_s(sc, float(gold["wall_s"]))
    checks["d_time"] = f"{wall:.1f} s (bound {bound_s:.0f} s)"
    if wall > bound_s:
        failures.append(f"d: took {wall:.1f} s > bound {bound_s:.0f} s")
    # e. nothing left behind
    checks["e_no_leftover"] = "fail" if leftover else "pass"
    if leftover:
        failures.append("e: processes of the run were still alive after it ended")
    if checks["a_bitwise_equal"] not in ("pass",) and sc.hosts == 1:
        failures.append(f"a: final digest {digest} != golden {gold['digest']}")
    return checks


def describe(result: Result) -> str:
    if result.skipped:
        return f"SKIP {result.scenario}: {result.skipped}"
    status = "PASS" if result.ok else "FAIL"
    lines = [
        f"{status} {result.scenario}: {result.wall_s:.1f} s "
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
