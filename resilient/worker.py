"""The worker wrapper of `resilient run --hot-recovery`: runs the training script, and runs it
again in the same process after a hot recovery (resilient/runtime/hot.py).

    python -u -m resilient.worker SCRIPT ARGS...       # what the agent starts per local rank
    python -u -m resilient.worker -m MODULE ARGS...

The script runs as `python SCRIPT ARGS` would run it (`__main__`, sys.argv, sys.path[0]), so
a script needs no change. When a peer is lost, a surviving rank's Runtime raises HotRestart;
the wrapper then waits for the agent's next generation and runs the script again: python,
torch and the script's imports stay loaded, the in-memory snapshots stay in host memory. Any
other ending (a return, SystemExit, an exception) is the script's own, with its exit code.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

from resilient.envvars import ENV_GENERATION
from resilient.runtime import hot


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


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("usage: python -m resilient.worker SCRIPT ARGS... | -m MODULE ARGS...")
    while True:
        try:
            _run(list(argv))
            return
        except hot.HotRestart:
            pass
        # The unwound script's frames (model, optimizer, loader iterators) are garbage now:
        # collect them, so their finalizers run before the next generation starts.
        gc.collect()
        os.environ[ENV_GENERATION] = str(hot.await_generation())


if __name__ == "__main__":
    main(sys.argv[1:])
