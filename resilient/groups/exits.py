"""Leaving the process now, the one way a rank exits when its peers may be stuck.

A rank that must go while a collective may never return (a lost peer, a hang verdict) cannot
rely on the interpreter's normal shutdown: atexit handlers and thread joins would wait on the
very collective that is stuck. These two leave at once, after flushing what was logged.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Any, NoReturn

from resilient.log import get_logger


def exit_now(code: int, **fields: Any) -> NoReturn:
    """Log `watchdog.exit` with `fields`, flush, and leave with `code` (no verdict needed:
    used where every rank reached the same decision together)."""
    get_logger().error("watchdog.exit", code=int(code), **fields)
    hard_exit(code)


def hard_exit(code: int) -> NoReturn:
    """Leave now: no atexit, no joins (a thread may be stuck in a collective forever)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to save
            stream.flush()
    os._exit(int(code))


def exit_past_teardown(code: int) -> NoReturn:
    """Leave as the interpreter would, less its final teardown: join the non-daemon threads,
    run the atexit handlers, flush, exit with `code`. For a process that left a generation
    behind in a hot recovery (groups.abandon_distributed): the teardown frees that
    generation's process groups, and a gloo group's destructor joins its transport loop
    thread, which can spin forever on the lost generation's pairs (seen at the end of 1 in
    about 10 pipeline runs: every step done, the process never gone)."""
    # what Py_FinalizeEx runs first, in its order (CPython's own hooks, 3.10-3.13): the
    # threading module's exit hooks (executors stop their idle workers) and the joins of
    # non-daemon threads, then the atexit handlers (logging's shutdown among them)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    hard_exit(code)
