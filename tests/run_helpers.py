"""Helpers for the `resilient run` tests: launching it, reading what the worker recorded.

The worker is tests/workers/supervised_train.py; it appends one JSON line per completed step
to <record>/rank<R>.jsonl.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import REPO_ROOT, WORKERS

from chaos.procs import kill_tree as _kill_tree
from resilient.events import read_events

WORKER = WORKERS / "supervised_train.py"


def run_cmd(*args: str) -> list[str]:
    """`python -m resilient.cli run ARGS` as an argv list."""
    return [sys.executable, "-m", "resilient.cli", "run", *args]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), e.get("PYTHONPATH", "")) if p)
    return e


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session with output to `log` (kill it with kill_tree)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env(),
            cwd=REPO_ROOT,
            start_new_session=True,
        )


def kill_tree(proc: subprocess.Popen[bytes], pids: tuple[int, ...] = ()) -> None:
    """SIGKILL a launcher's whole tree, its process group and the given worker pids."""
    _kill_tree(proc.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def records(record_dir: Path) -> list[dict[str, Any]]:
    return read_events(record_dir, pattern="rank*.jsonl")


def events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    return read_events(run_dir, name)


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the newest attempt, from the ranks' runtime.init events."""
    pids: dict[int, int] = {}
    for ev in events(run_dir, "runtime.init"):
        pids[int(ev["rank"])] = int(ev["pid"])
    return pids


def last_by_step(recs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Step -> the records of the last attempt that completed it (a replayed step replaces
    what an attempt that failed before checkpointing it had recorded)."""
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = {}
    order: dict[str, float] = {}
    for r in recs:
        by_step.setdefault(r["step"], {}).setdefault(r["attempt"], []).append(r)
        order[r["attempt"]] = min(order.get(r["attempt"], r["t"]), r["t"])
    return {step: per[max(per, key=lambda a: order[a])] for step, per in sorted(by_step.items())}
