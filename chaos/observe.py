"""Reading what a run did, from outside it: the steps rank 0 printed (per attempt), each
rank's `runtime.init` events, and the harness's own records in <run_dir>/logs/chaos.jsonl.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

from chaos.procs import events
from resilient.events import read_events

__all__ = [
    "_attempt_inits",
    "_attempt_steps",
    "_chaos_records",
    "_epoch",
    "_inits",
    "_printed_steps",
    "_since_attempt",
]


_STEP_LINE = re.compile(r"^step (\d+) loss", re.M)


def _printed_steps(text: str) -> list[int]:
    return [int(s) for s in _STEP_LINE.findall(text)]


def _inits(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The rank's `runtime.init` events, one per attempt, across launches, in order."""
    return [e for e in events(run_dir, rank) if e.get("event") == "runtime.init"]


def _attempt_inits(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The rank's `runtime.init` events that start an attempt: a hot replacement (generation
    >= 1, `resilient run --hot-recovery`) joins the attempt it replaces a process in."""
    return [e for e in _inits(run_dir, rank) if int(e.get("generation") or 0) == 0]


def _chaos_records(run_dir: Path) -> list[dict[str, Any]]:
    return read_events(run_dir / "logs" / "chaos.jsonl")


_ATTEMPT_MARK = "runtime.resume"


def _attempt_parts(text: str) -> list[str]:
    """stdout cut at rank 0's resume lines that start an attempt (a hot recovery's resume,
    `hot=True`, continues its attempt); what comes before the first one is dropped."""
    parts: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        if _ATTEMPT_MARK in line and "hot=True" not in line:
            parts.append([])
        if parts:
            parts[-1].append(line)
    return ["".join(p) for p in parts]


def _since_attempt(text: str, attempt: int) -> str:
    """stdout from the given attempt on (attempts are separated by rank 0's resume line)."""
    return "".join(_attempt_parts(text)[attempt:])


def _attempt_steps(text: str) -> list[list[int]]:
    """The steps rank 0 printed, per attempt."""
    return [_printed_steps(part) for part in _attempt_parts(text)]


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
