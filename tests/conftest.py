"""Shared fixtures: free ports, subprocess launchers (torchrun or plain python), event logs.

Launched processes run in their own process group so a hung rank can be killed with its
launcher; every launch has a timeout, and the session kills whatever is still alive at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.procs import kill_tree
from resilient import log
from resilient.events import read_events

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

Result = tuple[int, str, str]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL `proc`'s whole tree: torch elastic starts workers in sessions of their own,
    so the process group `proc` leads would miss them."""
    kill_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(proc.pid, signal.SIGKILL)


class Launcher:
    """Runs commands in their own process group with a timeout; kills leftovers on close."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []

    def run(self, cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Result:
        """Run `cmd` to completion; return (returncode, stdout, stderr).

        On timeout the whole process group is killed and pytest fails with the output so far.
        """
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p
        )
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            pytest.fail(
                f"{' '.join(cmd)} timed out after {timeout} s\n--- stdout\n{out[-4000:]}\n"
                f"--- stderr\n{err[-8000:]}"
            )
        finally:
            _kill_group(proc)  # ranks a crashed launcher left behind
        return proc.returncode, out, err

    def close(self) -> None:
        for proc in self._procs:
            _kill_group(proc)
            if proc.poll() is None:
                proc.wait(timeout=10)
        self._procs.clear()


@pytest.fixture(scope="session")
def launcher() -> Iterator[Launcher]:
    launcher = Launcher()
    yield launcher
    launcher.close()


@pytest.fixture(scope="session")
def torchrun(launcher: Launcher) -> Callable[..., Result]:
    """`torchrun(nproc, script, *args, timeout=120)` -> (returncode, stdout, stderr).

    Launches `python -m torch.distributed.run` on loopback with a free port; `script` is a path
    or a name under tests/workers.
    """

    def run(
        nproc: int,
        script: str | Path,
        *args: str,
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> Result:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(_script(script)),
            *args,
        ]
        return launcher.run(cmd, timeout=timeout, env=env)

    return run


@pytest.fixture(scope="session")
def python_proc(launcher: Launcher) -> Callable[..., Result]:
    """`python_proc(script, *args, timeout=120)`: one plain process, no torchrun."""

    def run(
        script: str | Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None
    ) -> Result:
        return launcher.run([sys.executable, str(_script(script)), *args], timeout=timeout, env=env)

    return run


def _script(script: str | Path) -> Path:
    p = Path(script)
    return p if p.is_absolute() else WORKERS / p


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Callable[[str | None], list[dict[str, Any]]]]:
    """Route resilient's events to a JSON log under tmp_path; returns `read(event=None)`."""
    path = log.configure(
        run_dir=tmp_path / "run",
        run_id="test",
        rank=0,
        restart=0,
        console_level="CRITICAL",
    )
    assert path is not None

    def read(event: str | None = None) -> list[dict[str, Any]]:
        return read_events(path, event)

    yield read
    log.configure(run_dir=None, run_id="test", rank=0, restart=0)
