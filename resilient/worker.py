"""The worker wrapper of `resilient run --hot-recovery`: runs the training script, and runs it
again in the same process after a hot recovery (resilient/hot/recovery.py).

    python -u -m resilient.worker SCRIPT ARGS...       # what the agent starts per local rank
    python -u -m resilient.worker -m MODULE ARGS...
    python -u -m resilient.worker --spare              # a warm spare (supervisor/spare.py)

A spare imports torch and the runtime, then waits on stdin for one JSON line: the environment,
arguments and log files of the local rank it replaces. It then becomes that worker, without
paying for python's start and torch's import on the recovery's critical path.

The script runs as `python SCRIPT ARGS` would run it (`__main__`, sys.argv, sys.path[0]), so
a script needs no change. When a peer is lost, a surviving rank's Runtime raises HotRestart;
the wrapper then waits for the agent's next generation and runs the script again: python,
torch and the script's imports stay loaded, the in-memory snapshots stay in host memory. A
peer's loss that escapes the script as an ordinary exception takes the same path. Any other
ending (a return, SystemExit, an exception) is the script's own, with its exit code.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time
from typing import Any

from resilient import faultpoints
from resilient.envvars import ENV_GENERATION, HotMode
from resilient.groups.exits import exit_past_teardown
from resilient.groups.groups import left_generations_behind
from resilient.hot import carry, gapwatch, reform
from resilient.hot.framework_state import forget_framework_state
from resilient.hot.recovery import HotRestart, divert_escaped
from resilient.hot.script_store import point_at_generation_store
from resilient.runtime.runtime import current

_PR_SET_PDEATHSIG = 1
"""prctl(2): the signal this process gets when its parent dies."""


def _run(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = argv[0], argv[1:]
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _become_assigned() -> list[str]:
    """As a spare: wait for the assignment, take its environment and log files; its argv."""
    import json

    import torch
    import torch._dynamo  # the first optimizer imports it lazily: about 1 s on CPU
    import torch.distributed.checkpoint  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import resilient.runtime.runtime  # noqa: F401

    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the agent let this spare go unused
    job = json.loads(line)
    for fd, path in ((1, job.get("stdout")), (2, job.get("stderr"))):
        if path:
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
    os.environ.clear()
    os.environ.update(job["env"])
    return list(job["argv"])


def _uncaught_handler() -> Any:
    """The running Runtime's guard entry for an escaped exception (None: no Runtime up)."""
    try:
        return current().guards.on_uncaught
    except RuntimeError:  # no Runtime, or already closed or abandoned
        return None


def _leave(end: BaseException | None) -> None:
    """The script ended (`end`: its SystemExit or exception, None for a return). In a process
    that left a generation behind (a hot recovery's survivor), end it here as python would,
    less the interpreter's teardown, which would free that generation's process groups and
    can hang in a gloo destructor (groups/exits.py). Elsewhere return: python ends it."""
    if not left_generations_behind():
        return
    if end is None:
        exit_past_teardown(0)
    if isinstance(end, SystemExit):
        if end.code is None or isinstance(end.code, int):
            exit_past_teardown(end.code or 0)
        print(end.code, file=sys.stderr)  # what python does with a non-int code
        exit_past_teardown(1)
    sys.excepthook(type(end), end, end.__traceback__)
    exit_past_teardown(1)


def _die_with_the_launcher() -> None:
    """SIGKILL this process when its parent, the launcher's agent, dies (kill -9, the OOM
    killer). A worker outside a generation has no watchdog to notice: a replacement waiting in
    the script's own init_process_group would wait out that call's timeout (30 minutes),
    holding its memory and cores. Linux only; the agent starts its workers from its main
    thread, whose end the kernel watches. A save cut short this way is never committed."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call above could take effect
        os._exit(1)


def main(argv: list[str]) -> None:
    _die_with_the_launcher()
    if argv[:1] == ["--spare"]:
        argv = _become_assigned()
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("usage: python -m resilient.worker SCRIPT ARGS... | -m MODULE ARGS...")
    # torch's and the runtime's ~300,000 objects out of the collector's sight: the full
    # collection after a hot restart took 0.17 s of the recovery with them, microseconds
    # without (nothing is leaked: a frozen object is still freed when its refcount drops)
    gc.freeze()
    while True:
        # a script that makes its own process group gets a fresh store in each hot generation
        point_at_generation_store(HotMode.from_env().generation)
        try:
            _run(list(argv))
        except HotRestart:
            pass
        except SystemExit as end:
            _leave(end)
            raise
        except Exception as exc:
            # A peer's loss noticed outside the guard (a user's own collective, a save that
            # finds the previous async write failed on the lost peer) escaped the script. The
            # excepthook would see it only after this wrapper returned, too late to run the
            # script again: hand it to the Runtime's guard here instead.
            if not divert_escaped(_uncaught_handler(), exc):
                _leave(exc)
                raise
        else:
            _leave(None)
            return
        held = carry.peek()
        faultpoints.hit(faultpoints.HOT_LEFT, generation=held.generation if held else -1)
        # the script's next Accelerator() must make its process group, as the replacement's does
        forget_framework_state()
        # The unwound script's frames (model, optimizer, loader iterators) are garbage now:
        # collect them, so their finalizers run before the next generation starts.
        t0 = time.monotonic()
        gc.collect()
        gc.freeze()  # what is left (the script's own imports) stays out of the next one
        carry.note("gc_s", time.monotonic() - t0)
        gapwatch.disarm()  # armed as it left (hot/recovery.py); the waits below are bounded
        os.environ[ENV_GENERATION] = str(reform.await_generation())


if __name__ == "__main__":
    main(sys.argv[1:])
