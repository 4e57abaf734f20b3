"""What a stuck launch was doing, written down before the harness kills it.

A test or a soak that times out kills the launcher's tree; what each process was doing at
that moment is gone with it, and a hang met once in CI cannot be read afterwards. `describe`
collects, while the tree still lives:
- each process's Python stacks, through py-spy (a dev dependency) when it may attach
  (root, or ptrace allowed); otherwise the reason it could not;
- the last events of each log in the run directory (each rank's and the supervisor's).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from resilient.events import read_events

__all__ = ["describe"]

_DUMP_S = 10.0
"""At most this long for one process's stacks (py-spy pauses it to read them)."""


def describe(pid: int, run_dir: Path | None = None, *, max_procs: int = 16) -> str:
    """The tree under `pid` (itself included): each process's command and stacks, then the
    last events of `run_dir`'s logs. Never raises: a part that fails says why."""
    parts = [_stacks(p) for p in _tree(pid)[:max_procs]]
    if run_dir is not None:
        parts.append(_last_events(run_dir))
    return "\n".join(parts)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _stacks(proc: psutil.Process) -> str:
    try:
        head = f"=== pid {proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error as e:
        return f"=== pid {proc.pid}: gone ({type(e).__name__})"
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return f"{head}\n(no stacks: py-spy is not installed)"
    try:
        out = subprocess.run(
            [spy, "dump", "--pid", str(proc.pid)],
            capture_output=True,
            text=True,
            timeout=_DUMP_S,
        )
    except subprocess.TimeoutExpired:
        return f"{head}\n(no stacks: py-spy took over {_DUMP_S:.0f} s)"
    text = out.stdout if out.returncode == 0 else f"(py-spy failed: {out.stderr.strip()[:300]})"
    return f"{head}\n{text.strip()}"


def _last_events(run_dir: Path, per_log: int = 4) -> str:
    lines = [f"=== last events in {run_dir}/logs"]
    for log in sorted((run_dir / "logs").glob("*.jsonl")):
        try:
            tail = read_events(log)[-per_log:]
        except OSError as err:
            lines.append(f"{log.name}: unreadable ({err})")
            continue
        for event in tail:
            where = {k: event[k] for k in ("generation", "step", "phase", "reason") if k in event}
            lines.append(f"{log.name}: {event.get('ts', '?')} {event.get('event')} {where}")
    return "\n".join(lines)
