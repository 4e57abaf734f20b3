"""Process trees on psutil: a process's descendants, whether one still runs, killing a tree.

For a launcher and whatever it started: torch elastic starts each worker in a session of its
own and dataloader workers hang below those, so a launcher's process group misses most of its
tree. Used by the chaos harness and the tests; it signals only the pids it is given and their
descendants. A zombie counts as gone: it runs no code and holds no resource but its pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

import psutil

__all__ = ["alive", "descendants", "group_alive", "kill_tree", "status"]

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def status(pid: int) -> str | None:
    """psutil's status of `pid` ("running", "sleeping", "stopped", "zombie", ...); None when
    there is no such process."""
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    st = status(pid)
    return st is not None and st not in _GONE


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, children before grandchildren ([] when it is gone)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def group_alive(pgid: int) -> bool:
    """Some process is still in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_tree(
    pid: int, *, also: Iterable[int] = (), groups: Iterable[int] = (), wait_s: float = 10.0
) -> list[int]:
    """SIGKILL `pid`, the pids in `also`, their descendants and every process group they are
    in (never our own), plus `groups`; then wait up to `wait_s` until none of them runs:
    SIGKILL lands when the process is next scheduled, which on a loaded machine is not at
    once, and callers check right after. The tree is collected before anything is killed (a
    killed parent's children would be reparented out of reach). Returns the pids still
    running after `wait_s` ([] normally).
    """
    roots = [pid, *also]
    pids = list(dict.fromkeys([*roots, *(d for r in roots for d in descendants(r))]))
    pgids = set(groups)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgids.add(os.getpgid(p))
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    for g in pgids - {os.getpgrp()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left
