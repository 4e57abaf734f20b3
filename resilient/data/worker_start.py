"""Loader workers stuck in their own fork, named in seconds instead of at a phase's timeout.

CPython 3.10 before 3.10.15 and 3.11 before 3.11.10 (CPython issue gh-112275; 3.12 and later
are fixed) can deadlock a forked child before it runs a line of Python: the child rebuilds the
interpreter's list of threads under a lock that it inherited locked, when another thread of
the parent held it at the instant of the fork. A training process has such a thread: torch's
gloo worker threads take that lock, without the GIL, whenever they drop the last reference to
a tensor whose Python object the caller released first (the object collectives of DCP and of
the runtime's agreements do), to make themselves a Python thread state. A DataLoader that forks
its workers in that instant gets one that never starts, and the rank waits for its first batch
for ever: measured here, 345 s in the first step of an attempt, until the first-step timeout
(docs/internals.md#g-fork-deadlock).

Nothing outside the interpreter can prevent it. On an affected interpreter, `WorkerStarts`
wraps a tracked loader's `worker_init_fn` (which a worker calls within milliseconds of its
fork: seeding, then the function) so that each worker writes its pid to a pipe as it starts;
`stuck()` then names a child of this process that the loader's iterator forked (the main
thread is inside `iter(loader)`) and that has not started after `after_s`. The watchdog turns
that into a verdict at once, instead of after the phase's timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["FIXED_IN", "WorkerStarts", "fork_deadlock_prone", "forks_workers"]

FIXED_IN = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}
"""The first release of each affected minor version with the fix; 3.12 and later have it."""

_PID = struct.Struct("=i")
_ON_LINUX = sys.platform.startswith("linux")
_KEEP = 4096  # started pids remembered; a pid reused by the OS only hides a stuck worker


def fork_deadlock_prone(version: tuple[int, ...] | None = None) -> bool:
    """This interpreter (or `version`) has CPython gh-112275."""
    v = tuple(sys.version_info[:3] if version is None else version)
    fixed = FIXED_IN.get((v[0], v[1]))
    return v[:2] < (3, 12) and (fixed is None or v < fixed)


def forks_workers(loader: Any) -> bool:
    """`loader` starts worker processes with fork (the default start method on Linux)."""
    if int(getattr(loader, "num_workers", 0) or 0) <= 0:
        return False
    ctx = getattr(loader, "multiprocessing_context", None)
    if isinstance(ctx, str):
        return ctx == "fork"
    if ctx is not None:
        return bool(ctx.get_start_method() == "fork")
    # unset: the platform's default, the first of these (get_start_method() would fix it)
    method = multiprocessing.get_start_method(allow_none=True)
    return (method or multiprocessing.get_all_start_methods()[0]) == "fork"


def python_fix() -> str:
    """What to upgrade to, for the messages."""
    fixed = FIXED_IN.get(sys.version_info[:2])
    to = ".".join(map(str, fixed)) if fixed else "3.12"
    return (
        f"upgrade Python {platform.python_version()} to {to} or later (CPython gh-112275), or "
        "give the loader multiprocessing_context='forkserver' (a dataset defined in the "
        "script's __main__ must then be importable)"
    )


class WorkerStarts:
    """The pids of `loader`'s workers that started, through a wrapped `worker_init_fn`."""

    def __init__(self, loader: Any) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)  # a full pipe never blocks a worker
        self.started: dict[int, None] = {}
        loader.worker_init_fn = _MarkStart(self._write, loader.worker_init_fn)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def stuck(self, since: float | None, after_s: float) -> list[int]:
        """Children of this process forked since `since` (a wall time: when the main thread
        entered `iter(loader)`; None: it is not in there) that have not started after
        `after_s` seconds. Drains the pipe either way, so it never fills."""
        self._drain()
        now = time.time()
        if since is None or now - since < after_s:
            return []
        # ages on the clock a process's start time is kept on: psutil's create_time() adds it
        # to a boot time rounded to whole seconds, up to 1 s early against time.time()
        now_boot = _since_boot()
        since_boot = since - now + now_boot
        me = psutil.Process()
        try:
            argv = me.cmdline()
            kids = me.children()
        except psutil.Error:
            return []
        stuck = []
        for kid in kids:
            with contextlib.suppress(psutil.Error, OSError):  # OSError: it exited meanwhile
                born = _born_since_boot(kid)
                # forked by this iterator: born inside the call, this process's own image
                ours = born >= since_boot - 0.05 and kid.cmdline() == argv
                if ours and now_boot - born >= after_s and kid.pid not in self.started:
                    stuck.append(kid.pid)
        return stuck

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._read, 4096 - 4096 % _PID.size)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            for (pid,) in _PID.iter_unpack(data[: len(data) - len(data) % _PID.size]):
                self.started[pid] = None
            while len(self.started) > _KEEP:
                del self.started[next(iter(self.started))]


def _since_boot() -> float:
    """Seconds since boot, counting suspended time, as Linux keeps process start times. Off
    Linux, the wall clock (psutil's start times are then on it)."""
    if not _ON_LINUX:
        return time.time()
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _born_since_boot(proc: psutil.Process) -> float:
    """When `proc` started, on `_since_boot()`'s clock: to the kernel's clock tick (10 ms)."""
    if not _ON_LINUX:
        return float(proc.create_time())
    with open(f"/proc/{proc.pid}/stat", "rb") as f:
        stat = f.read()
    # the fields after the command name, which may itself hold spaces and parentheses
    start_ticks = int(stat.rsplit(b")", 1)[1].split()[19])
    return start_ticks / os.sysconf("SC_CLK_TCK")


class _MarkStart:
    """The loader's worker_init_fn, after this worker's pid went into the pipe."""

    resilient_wrapper = True
    """The runtime peels its wrappers off before wrapping again (a loader tracked twice)."""

    def __init__(self, fd: int, inner: Callable[[int], Any] | None) -> None:
        self.fd = fd
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        with contextlib.suppress(OSError):  # full, or closed: the watchdog may misname it
            os.write(self.fd, _PID.pack(os.getpid()))
        if self.inner is not None:
            self.inner(worker_id)
