"""What one process can learn about another on the same host (psutil): whether a rank's pid
is still that rank's process, whether it is stopped, its child processes, and Python stacks
of a process that cannot dump its own (py-spy, where installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil

__all__ = ["NO_PYSPY", "children", "dump_with_pyspy", "process_state", "start_time"]

NO_PYSPY = "none: py-spy is not installed"


def start_time(pid: int) -> float | None:
    """The process's creation time (tells a reused pid apart); None when it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_state(meta: dict[str, Any], host: str) -> str:
    """stopped, dead or running for the rank described by `meta` (its heartbeat metadata:
    host, pid, start) when it runs on `host`; "unknown (another host)" elsewhere."""
    if not meta or meta.get("host") != host:
        return "unknown (another host)"
    try:
        proc = psutil.Process(int(meta["pid"]))
        if meta.get("start") is not None and proc.create_time() != float(meta["start"]):
            return "dead"  # the pid belongs to another process now
        status = proc.status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "dead"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    return "dead" if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "running"


def children(pid: int) -> list[dict[str, Any]]:
    """The process's descendants: pid, name, status (DataLoader workers, compilers, ...)."""
    out: list[dict[str, Any]] = []
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return out
    for p in procs:
        try:
            out.append({"pid": p.pid, "name": p.name(), "status": p.status()})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def dump_with_pyspy(pid: int, path: Path, header: str) -> str:
    """Append py-spy's dump of `pid` to `path`; returns the path, or why there is none."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        return NO_PYSPY
    try:
        out = subprocess.run(
            [pyspy, "dump", "--nonblocking", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"none: py-spy failed: {e}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"\n# {header} via py-spy:\n")
        f.write(out.stdout or out.stderr)
    return str(path) if out.returncode == 0 else f"none: py-spy: {out.stderr.strip()[:200]}"
