"""Fixtures: subprocess launchers (torchrun or plain python) and a run's event log.

Launched processes run in their own session so a hung rank can be killed with its launcher;
every launch has a timeout, and the session kills whatever is still alive at the end. The
helpers behind them live in tests/helpers.py, which test modules import directly.
"""

from __future__ import annotations

import os

# One thread per process for the whole session, set before anything imports torch: torchrun
# gives its workers this already, and the fork servers (fixture below) can then start the
# launchers, the plain ranks and torchrun's workers from one imported interpreter each.
os.environ["OMP_NUM_THREADS"] = "1"
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import WORKERS, ForkedCli, Launcher, Result, free_port, guarded_golden_run
from skipcheck import (  # noqa: F401  (hooks: a skip for an unexpected reason fails the run)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

from chaos import procs
from resilient import log
from resilient.events import read_events


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Python commands the tests launch start as forks of one process that imported torch
    once (chaos/forks/: same pid, parent, session, stdio and exit as a fresh
    interpreter), sparing each about 5 s of CPU. TEST_FRESH_INTERPRETERS=1 turns it off."""
    if os.environ.get("TEST_FRESH_INTERPRETERS") == "1":
        yield
        return
    procs.use_fork_server(tmp_path_factory.mktemp("forks"))
    yield
    procs.use_fork_server(None)


@pytest.fixture(autouse=True)
def _fresh_interpreters(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked `fresh_interpreters` launch new interpreters (the real start path)."""
    if request.node.get_closest_marker("fresh_interpreters") is None:
        yield
        return
    with procs.fresh_interpreters():
        yield


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


@pytest.fixture(scope="session")
def forked_cli() -> ForkedCli:
    """`forked_cli(*commands, env=None, timeout=50)`: `resilient COMMAND` for each command,
    side by side, each a process of its own; CompletedProcess results in order."""
    return ForkedCli()


@pytest.fixture(scope="session")
def guarded_golden(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`guarded_golden(nproc, fsdp=False)`: the digest of the guarded worker's fault-free run
    (helpers.guarded_golden_run), run once for the session: tests/test_hot.py and
    tests/test_rollback.py compare their faulty runs with the same ones."""
    digests: dict[tuple[int, bool], str] = {}

    def get(nproc: int, fsdp: bool = False) -> str:
        key = (nproc, fsdp)
        if key not in digests:
            out = tmp_path_factory.mktemp(f"guarded_golden{nproc}{'_fsdp' if fsdp else ''}")
            digests[key] = guarded_golden_run(out, nproc, fsdp=fsdp)
        return digests[key]

    return get


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
