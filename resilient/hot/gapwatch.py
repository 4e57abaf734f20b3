"""A survivor's watch over its own way out of a generation.

Between a peer's loss and the next generation's roll call a survivor runs no watchdog: its
own stopped with the generation, and the next starts with the next Runtime. What it runs there
is the runtime's teardown (the drains of a save or replica exchange in flight, each bounded),
the unwinding of the script's frames, and the collection of their garbage, where a process
group's destructor can block in gloo for good
(docs/hot-recovery.md#a-survivor-stuck-between-generations).
The other ranks cannot tell such a survivor from one re-running slow set-up code, so their
roll call waits for it until `startup_timeout_s` (15 minutes by default).

So the survivor watches itself over the part that is the runtime's own: from the moment it
leaves its generation until its garbage is collected. Python's faulthandler does it from a C
thread that needs no GIL (a destructor blocked in C may hold it): past the allowance it
writes every thread's stack to the rank's stacks file and exits 1. The agent sees a worker
fail while the generation forms and restarts the group cold, in well under a minute.
faulthandler has one such timer per process: a script's own `dump_traceback_later` is
cancelled here, and the script re-runs after it.
"""

from __future__ import annotations

import faulthandler
import time
from pathlib import Path
from typing import IO

__all__ = ["arm", "disarm"]

_file: list[IO[str]] = []
"""The stacks file faulthandler writes to while armed (it must stay open until then)."""


def arm(stacks_path: Path, seconds: float, *, generation: int) -> None:
    """From now on: dump every thread's stack into `stacks_path` and exit 1 unless `disarm()`
    comes within `seconds`. `generation`: the one this survivor is on its way to."""
    disarm()
    stacks_path.parent.mkdir(parents=True, exist_ok=True)
    out = stacks_path.open("a")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # one line per departure; "Timeout (h:mm:ss)!" and the stacks follow it only if it fires
    out.write(f"--- {stamp}: leaving for hot generation {generation}; if stacks follow, ")
    out.write(f"this survivor was still on its way after {seconds:g} s and exited 1\n")
    out.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=out)
    _file.append(out)


def disarm() -> None:
    """The survivor's own part of the way is done (or it never left): no dump, no exit."""
    faulthandler.cancel_dump_traceback_later()
    while _file:
        _file.pop().close()
