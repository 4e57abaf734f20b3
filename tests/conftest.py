"""Fixtures: subprocess launchers (torchrun or plain python) and a run's event log.

Launched processes run in their own session so a hung rank can be killed with its launcher;
every launch has a timeout, and the session kills whatever is still alive at the end. The
helpers behind them live in tests/helpers.py, which test modules import directly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import WORKERS, Launcher, Result, free_port

from resilient import log
from resilient.events import read_events


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
