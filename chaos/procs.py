"""Launching real runs and injecting process faults into them.

Everything here acts only on processes it started: runs get their own session (process
group), and faults target PIDs read from the run's own event log.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from chaos import forks
from resilient.events import iter_events
from resilient.proctree import alive, descendants, kill_tree

__all__ = [
    "Run",
    "alive",
    "descendants",
    "events",
    "fresh_interpreters",
    "kill_tree",
    "latest_event",
    "resumed_step",
    "spawn",
    "torchrun_cmd",
    "use_fork_server",
    "wait_for",
]

REPO = Path(__file__).resolve().parents[1]


def spawn(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    inherit_env: bool = True,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start `cmd` in a session of its own (so its tree can be killed apart from ours), in the
    checkout, with the checkout first on PYTHONPATH; `env` adds to ours (is the whole
    environment with `inherit_env=False`); `popen` goes to subprocess.Popen."""
    full = {**(os.environ if inherit_env else {}), **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full.get("PYTHONPATH")) if p)
    popen_class = forks.ForkedPopen if _FORKS is not None and not _FRESH else subprocess.Popen
    return popen_class(list(cmd), env=full, cwd=cwd or REPO, start_new_session=True, **popen)


_FORKS: forks.ForkServers | None = None
_FRESH = False


def use_fork_server(workdir: Path | None) -> None:
    """From now on `spawn` starts Python commands as forks of one process that imported torch
    and the runtime once (chaos/forks/), with the same pid, parent, session, stdio,
    environment and exit as a fresh interpreter; `None` stops that and ends the server. It
    spares each start about 5 s of CPU: the tests turn it on for their session."""
    global _FORKS
    if _FORKS is not None:
        _FORKS.close()
    _FORKS = forks.ForkServers(workdir) if workdir is not None else None
    forks.set_servers(_FORKS)


@contextlib.contextmanager
def fresh_interpreters() -> Iterator[None]:
    """Within: `spawn` starts new interpreters even with the fork server on (the real start
    path: each process imports everything and draws its own hash seed)."""
    global _FRESH
    _FRESH, before = True, _FRESH
    try:
        yield
    finally:
        _FRESH = before


def torchrun_cmd(
    script: str | Path,
    args: Sequence[str],
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """A torchrun command line with a standalone rendezvous on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        *extra,
        str(script),
        *args,
    ]


class Run:
    """A launched command in its own process group, with stdout+stderr in a file."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        append: bool = False,
    ) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("ab" if append else "wb")
        self.started = time.monotonic()
        self.proc = spawn(cmd, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int:
        """Exit code; on timeout the whole group is killed and TimeoutError raised."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"run did not finish in {timeout:.0f} s; log: {self.log_path}"
            ) from None
        finally:
            self._log.flush()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self, also: Sequence[int] = ()) -> None:
        """SIGKILL the run's whole process tree: launcher, workers, dataloader workers, and
        the pids in `also` (workers a crashed launcher left behind) with their trees.

        Killing the launcher's process group is not enough: torch elastic starts every worker
        in a session of its own, so the tree is collected first (killing a parent first would
        reparent its children out of reach), then every process and group in it is killed.
        """
        kill_tree(self.proc.pid, also=also, groups=(self.proc.pid,))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        # a worker may outlive its launcher (its own session): sweep the whole tree
        self.kill()


def events(run_dir: Path, rank: int | None = None) -> Iterator[dict[str, Any]]:
    """Events from <run_dir>/logs/rank*.jsonl (a partial last line is skipped)."""
    return iter_events(run_dir / "logs", rank=rank, pattern="rank*.jsonl")


def latest_event(
    run_dir: Path,
    name: str,
    rank: int | None = None,
    where: Callable[[dict[str, Any]], bool] = lambda e: True,
) -> dict[str, Any] | None:
    found = None
    for e in events(run_dir, rank):
        if e.get("event") == name and where(e):
            found = e
    return found


def resumed_step(run_dir: Path) -> int | None:
    """The step rank 0's last attempt resumed from a checkpoint at (None: it started fresh).

    An async save commits in the background, so a kill a few steps after a save may land
    before or after its commit; what is certain is the save before it, which the next save
    waited for. Tests kill after the second save and accept either committed step."""
    last = latest_event(run_dir, "runtime.resume", rank=0) or {}
    return int(last["step"]) if last.get("from_checkpoint") else None


def wait_for(
    pred: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    poll: float = 0.05,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """Poll `pred` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = clock() + timeout
    while clock() < deadline:
        value = pred()
        if value:
            return value
        sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
