"""Leaving the process now, the one way a rank exits when its peers may be stuck.

A rank that must go while a collective may never return (a lost peer, a hang verdict) cannot
rely on the interpreter's normal shutdown: atexit handlers and thread joins would wait on the
very collective that is stuck. These two leave at once, after flushing what was logged.
"""

from __future__ import annotations

import contextlib
import os
import sys
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
