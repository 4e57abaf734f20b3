"""What the supervisor's agent reads of its worker processes' state, without disturbing them.

torch elastic's process context reaps the workers (Popen); the agent must see a worker's exit
before torch's own poll does (to leave its peers running under hot recovery, or to SIGKILL
them at once), so it peeks at the status without reaping it. Shared by the agent's lifecycle
(agent.py) and its hot recovery (hot.py); agent.py imports hot.py, so they live apart from both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

__all__ = ["is_stopped", "kill_leftovers", "peek_exit", "wait_exits"]


def peek_exit(pid: int) -> int | None:
    """A child's exit status without reaping it (Popen still gets it): the code, -signal for
    a signalled child, or None while it runs (or once the process context reaped it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def wait_exits(pids: dict[int, int], wait_s: float, poll_s: float) -> dict[int, int | None]:
    """peek_exit of every local rank -> pid, polled every `poll_s` until all have exited or
    `wait_s` has passed; None for those still running."""
    deadline = time.monotonic() + wait_s
    while True:
        codes = {lr: peek_exit(pid) for lr, pid in pids.items()}
        if None not in codes.values() or time.monotonic() >= deadline:
            return codes
        time.sleep(poll_s)


def is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, or stopped by a tracer)."""
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def kill_leftovers(exited: dict[int, int]) -> None:
    """SIGKILL the process groups of workers that have exited but are not reaped yet (local
    rank -> pid): what they leave behind. Each worker leads its own session, and a child of
    it outlives it there: a loader worker deadlocked in its own fork (CPython 3.11, a fork
    while another thread of the rank held the interpreter's thread-state lock) slept on,
    orphaned, holding the launcher's output pipe. Only an unreaped worker's group: its pid,
    the group's id, cannot have been reused yet."""
    for pid in exited.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
