"""`python -m resilient.cli` many times over, for the price of one interpreter start.

Imports what the commands load (torch, the checkpoint code, s3fs) once, prints `ready`,
then reads one JSON request a line on stdin: {"args", "env", "cwd", "out", "err"}. For each
it forks a child that is the command: stdin from /dev/null, stdout and stderr into the files
named, the environment and working directory given, `resilient.cli` run as `__main__`
(as `-m` runs it), its exit handlers, and its exit code, as the interpreter would give it.
The children of one request line run side by side; the answer is one JSON line of their exit
codes, in order. The tests (conftest.py's forked_cli) check every command's output as they
did with a fresh interpreter; this only spares each command its start and its torch import.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

# what the commands import: loaded here once (each child finds them in sys.modules); not
# resilient.cli itself, which each child runs afresh as __main__
import s3fs  # noqa: F401
import torch  # noqa: F401

import resilient.checkpoint.manager
import resilient.report
import resilient.supervisor.launcher
import resilient.weights.export  # noqa: F401


def _exit_code(code: object) -> int:
    """What the interpreter makes of SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(job: dict) -> None:
    """Become `python -m resilient.cli ARGS` and never return."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        sys.argv = ["resilient", *job["args"]]
        try:
            runpy.run_module("resilient.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        jobs = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for job in jobs:
            pid = os.fork()
            if pid == 0:
                _child(job)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        sys.stdout.write(json.dumps(codes) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
