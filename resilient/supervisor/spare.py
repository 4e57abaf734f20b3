"""A warm spare for hot recovery: a worker process started before it is needed.

Under `resilient run --hot-recovery` the agent keeps one spare per node: `python -u -m
resilient.worker --spare`, which starts python and imports torch and the runtime, then waits
on a pipe. When a local worker dies, the agent hands the spare that worker's environment
(plus the new generation), arguments and log files, and the spare becomes the worker
(resilient/worker.py); the agent then starts the next spare. Starting a python process and
importing torch takes seconds on a CPU host, most of a cold replacement's time; the spare has
done it already.

The spare is its own session leader, like every worker, so the agent's process-group kills
reach it and its children. It holds no rank, no store connection and no process group until
it is assigned.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["Spare"]


class Spare:
    """At most one waiting spare process; `take()` hands it a job."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> None:
        """Start a spare unless one is waiting."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "resilient.worker", "--spare"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        self.started_at = time.monotonic()

    @property
    def ready(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def take(
        self, *, env: dict[str, str], argv: list[str], stdout: str | None, stderr: str | None
    ) -> subprocess.Popen[bytes]:
        """Hand the waiting spare its job; returns its process. RuntimeError when none waits."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None or proc.stdin is None:
            raise RuntimeError("no spare process is waiting")
        job = {"env": env, "argv": argv, "stdout": stdout, "stderr": stderr}
        try:
            proc.stdin.write((json.dumps(job) + "\n").encode())
            proc.stdin.close()
        except OSError as e:
            raise RuntimeError(f"the spare process did not take its job: {e}") from e
        return proc

    def stop(self) -> None:
        """Let a waiting spare go (and reap it)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # an unassigned spare exits on end of input
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def spare_argv(args: tuple[Any, ...]) -> list[str] | None:
    """The wrapper's arguments in a worker's command line (what follows `-m
    resilient.worker`), or None when the workers do not run under the wrapper."""
    items = [str(a) for a in args]
    for i in range(len(items) - 1):
        if items[i] == "-m" and items[i + 1] == "resilient.worker":
            return items[i + 2 :]
    return None
