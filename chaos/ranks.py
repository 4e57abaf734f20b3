"""Launch N ranks as plain processes (no torchrun), so each rank's own exit code is visible.

torchrun tears the group down by itself as soon as one worker fails, which hides what the
other ranks would have done; these runs show it. Rank 0 hosts the store, as under a bare
`torch.distributed` launch. Every rank gets its own session, and `kill()` (also on exit of
the `with` block) resumes and kills whatever is left, stopped processes included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from chaos.procs import spawn

__all__ = ["Ranks", "free_port"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ranks:
    """`n` processes running `python ARGV` with the torch.distributed environment set."""

    def __init__(
        self,
        n: int,
        argv: Sequence[str],
        *,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.started = time.monotonic()
        self.logs = [log_dir / f"rank{r}.out" for r in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for r in range(n):
            rank_env = {
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                **(env or {}),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with self.logs[r].open("wb") as out:
                cmd = [sys.executable, *argv]
                self.procs.append(spawn(cmd, env=rank_env, stdout=out, stderr=subprocess.STDOUT))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit code; on timeout everything is killed and TimeoutError raised."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
            self.kill()
            raise TimeoutError(
                f"ranks {alive} still running after {timeout:.0f} s; logs: {self.logs[0].parent}"
            ) from None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def kill(self) -> None:
        """SIGCONT then SIGKILL each rank's session (a stopped process ignores all but KILL,
        and dataloader workers live in the same session)."""
        for p in self.procs:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
