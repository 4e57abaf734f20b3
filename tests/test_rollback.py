"""In-place rollback: a Python exception in one rank's step, every rank back to the newest
in-memory snapshot, no process lost, and the run ends bitwise equal to a fault-free one.

Two real gloo ranks running tests/workers/guarded_train.py with DDP micro-batches (the
guard's in-place agreement); the exception comes from chaos.inject. The fault-free run has
snapshots off, so the comparison also shows that taking them changes nothing; it is the
session's (conftest.py's guarded_golden), shared with tests/test_hot.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import GUARDED_STEPS, GUARDED_WATCHDOG, assert_no_process_left

from chaos.procs import events
from chaos.ranks import Ranks
from resilient.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKER = "tests/workers/guarded_train.py"
WATCHDOG = GUARDED_WATCHDOG


def _run(out: Path, faults: list[str], *, snapshot: bool, every: int | None = 1) -> list[int]:
    argv = ["-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--", WORKER]
    argv += ["--mode", "micro", "--steps", str(GUARDED_STEPS), "--workers", "0"]
    argv += ["--ckpt-dir", str(out / "ckpt"), "--run-dir", str(out / "run")]
    env = {
        "RESILIENT_WATCHDOG": json.dumps(WATCHDOG),
        "RESILIENT_SNAPSHOT": json.dumps({"enabled": snapshot, "every_steps": every}),
    }
    ranks = Ranks(2, argv, log_dir=out / "out", env=env)
    try:
        codes = ranks.wait(120)
        assert_no_process_left(ranks, out / "run")
    finally:
        ranks.kill()
    return codes


def _named(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in events(run) if e.get("event") == name]


def _digest(out: Path) -> str:
    return json.loads((out / "run" / "final_digest.json").read_text())["digest"]


@pytest.fixture(scope="module")
def golden(guarded_golden: Callable[..., str]) -> str:
    """The session's fault-free run on 2 ranks (under `resilient run`, snapshots off), which
    tests/test_hot.py compares with too: the same worker, schedule and bits."""
    return guarded_golden(2)


def test_an_exception_rolls_every_rank_back_in_place_bit_exact(golden: str, tmp_path: Path):
    codes = _run(tmp_path, ["raise@rank=1,step=5,phase=forward"], snapshot=True)
    run = tmp_path / "run"
    assert codes == [0, 0], codes
    assert _digest(tmp_path) == golden
    done = _named(run, "rollback.done")
    assert sorted(e["rank"] for e in done) == [0, 1] and {e["to_step"] for e in done} == {5}
    # no process was replaced: one init per rank, the same pids to the end
    inits = _named(run, "runtime.init")
    assert len(inits) == 2
    assert {e["pid"] for e in inits} == {e["pid"] for e in _named(run, "runtime.done")}
    (memory, *_) = [e for e in _named(run, "snapshot.memory") if e["rank"] == 0]
    assert memory["copies"] == 2 and memory["total_bytes"] == 2 * memory["bytes_per_copy"] > 0


def test_adaptive_interval_rolls_back_to_a_step_every_rank_holds(golden: str, tmp_path: Path):
    # the default interval: each rank picks its own from its copy and step times; the group
    # goes back to the newest step all of them hold, and replays from there
    codes = _run(tmp_path, ["raise@rank=0,step=6,phase=forward"], snapshot=True, every=None)
    assert codes == [0, 0], codes
    assert _digest(tmp_path) == golden
    (agreed, *_) = _named(tmp_path / "run", "rollback.agreed")
    assert agreed["to_step"] <= 6 and agreed["failed_rank"] == 0


def test_the_same_exception_at_the_same_step_again_goes_cold(tmp_path: Path):
    codes = _run(tmp_path, ["raise@rank=1,step=5,phase=forward,times=2"], snapshot=True)
    run = tmp_path / "run"
    assert codes == [ExitCode.RANK_EXCEPTION] * 2, codes
    assert len(_named(run, "rollback.done")) == 2  # the first failure, once per rank
    refused = _named(run, "rollback.refused")
    assert refused and all("same step" in e["reason"] for e in refused)
