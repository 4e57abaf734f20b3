"""Faults sent from outside a run: signals to a rank or to the launcher, damaged checkpoint
files, S3 errors and latency through the fault proxy, a full disk.

`_inject` waits until the run reached the fault's attempt and step, fires it, and appends a
`chaos.fault` event to the run's logs (`_record`), where `resilient report` finds it. Faults
armed inside the ranks (chaos/faults.py) are only waited for here.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec

from chaos.launch import _Env
from chaos.observe import _chaos_records, _epoch, _printed_steps, _since_attempt
from chaos.observe import _inits as _all_inits
from chaos.plan import Planned, plan
from chaos.procs import Run, kill_tree, latest_event, wait_for
from chaos.scenario import IN_PROCESS

__all__ = ["Injected", "_inject", "_record"]


_FILE_FAULTS = {"corrupt", "truncate", "delete"}


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
    buddy_pid: int | None = None
    """kill_with_buddy: the second worker killed."""


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


def _init_of(run_dir: Path, rank: int, p: Planned) -> dict[str, Any] | None:
    """`rank`'s runtime.init of the planned attempt and hot-recovery generation, if logged."""
    attempt = -1
    for e in _all_inits(run_dir, rank):
        gen = int(e.get("generation") or 0)
        attempt += gen == 0
        if attempt == p.attempt and gen == p.generation:
            return e
    return None


def _inject(p: Planned, env: _Env, run: Run) -> Injected:
    fault, sc, run_dir = p.fault, env.sc, env.run_dir
    wait_for(
        lambda: _init_of(run_dir, 0, p) is not None and _init_of(run_dir, fault.rank, p),
        timeout=sc.timeout_s,
        what=f"attempt {p.attempt}, generation {p.generation}",
    )
    victim = _init_of(run_dir, fault.rank, p)
    assert victim is not None
    pid = int(victim["pid"])
    base: dict[str, Any] = {
        "kind": fault.kind,
        "rank": fault.rank,
        "pid": pid,
        "attempt": p.attempt,
    }
    if fault.kind in IN_PROCESS:  # armed at launch: wait for the rank to report it fired
        # each fires once and records once, in step order (several may share an attempt
        # in hot mode, where an in-place recovery starts none)
        inside = [q.fault for q in plan(sc) if q.fault.kind in IN_PROCESS]
        n_before = next(i for i, f in enumerate(inside) if f is fault or f == fault)
        rec = wait_for(
            lambda: next(iter(_first_firings(_chaos_records(run_dir))[n_before:]), None),
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
        disk = env.disk

        def save_failed() -> dict[str, Any] | None:
            disk.fill()  # again at each look: retention may have deleted a checkpoint since
            return latest_event(run_dir, "ckpt.save.failed", None, lambda e: _epoch(e["ts"]) >= t)

        try:
            failed = wait_for(
                save_failed, timeout=sc.timeout_s, what="a save to fail on the full disk"
            )
        finally:
            env.disk.free()  # the operator frees space; the next attempt must save again
        info["bit"] = int(failed["step"])
    elif fault.kind == "sigterm":
        os.kill(run.proc.pid, signal.SIGTERM)
    elif fault.kind == "resize":  # the job loses its allocation: launcher and workers at once
        kill_tree(run.proc.pid, groups=(run.proc.pid,))
    elif fault.kind == "kill_with_buddy":  # both copies of a snapshot go at once
        buddy = (fault.rank + 1) % (sc.nproc * sc.hosts)
        buddy_init = wait_for(
            lambda: _init_of(run_dir, buddy, p), timeout=sc.timeout_s, what=f"rank {buddy}"
        )
        info["buddy_pid"] = int(buddy_init["pid"])
        os.kill(pid, signal.SIGKILL)
        os.kill(info["buddy_pid"], signal.SIGKILL)
    else:
        sig = {"sigstop": signal.SIGSTOP, "sigterm_rank": signal.SIGTERM}.get(
            fault.kind, signal.SIGKILL
        )
        os.kill(pid, sig)
    _record(run_dir, kind=fault.kind, target_rank=fault.rank, pid=pid, t=t, **info)
    return Injected(**base, wall_time=t, **info)


def _first_firings(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The in-process faults' records of their first firing, in order. A fault fired again
    records `repeat`; a bad batch, armed afresh in every process, records again in each
    attempt it meets: only its first record counts."""
    out, seen = [], set()
    for r in records:
        if r.get("source") == "runner" or r.get("repeat") is not None:
            continue
        if r.get("kind") == "bad_batch":
            where = (r.get("rank"), r.get("step"), r.get("phase"))
            if where in seen:
                continue
            seen.add(where)
        out.append(r)
    return out


def _record(run_dir: Path, *, t: float, **fields: Any) -> None:
    """Append a chaos.fault event to the run's logs, where `resilient report` finds it."""
    ts = datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
    with (run_dir / "logs" / "chaos.jsonl").open("a") as f:
        f.write(json.dumps({"event": "chaos.fault", "ts": ts, "source": "runner", **fields}) + "\n")
