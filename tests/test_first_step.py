"""A stall in the first step after a resume is named within `first_step_timeout_s`.

Two real gloo ranks with two DataLoader workers each: the first launch stops at step 4 with a
committed checkpoint; the second resumes from it, and rank 1's main thread sleeps in the
forward of its first step (chaos.inject). With a start-up allowance of 60 s, the stall must
be named after the first-step timeout (4 s) instead, with the sleeper's stacks and its
loader workers listed, and every rank must exit with ExitCode.HANG.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    assert_no_process_left,
    exit_events,
    fault_time,
    only_event,
    pid_of,
)

from chaos.procs import events
from chaos.ranks import Ranks
from resilient.events import timestamp
from resilient.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WATCHDOG = {
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 2.0,
    "timeout_s": 2.0,
    "first_step_timeout_s": 4.0,
    "startup_timeout_s": 60.0,
    "checkpoint_timeout_s": 60.0,
}
WORKER = "tests/workers/guarded_train.py"


def _launch(out: Path, faults: list[str], stop_at: int) -> tuple[list[int], Ranks]:
    argv = ["-m", "chaos.inject", *[a for f in faults for a in ("--fault", f)], "--", WORKER]
    argv += ["--mode", "none", "--workers", "2", "--steps", "8", "--stop-at", str(stop_at)]
    argv += ["--ckpt-dir", str(out / "ckpt"), "--run-dir", str(out / "run")]
    ranks = Ranks(
        2, argv, log_dir=out / f"out{stop_at}", env={"RESILIENT_WATCHDOG": json.dumps(WATCHDOG)}
    )
    try:
        codes = ranks.wait(100)
        assert_no_process_left(ranks, out / "run")
    finally:
        ranks.kill()
    return codes, ranks


def test_a_stall_in_the_first_step_after_a_resume_is_named_in_seconds(tmp_path: Path) -> None:
    codes, _ = _launch(tmp_path, [], stop_at=4)
    assert codes == [0, 0], codes
    codes, ranks = _launch(tmp_path, ["hang@rank=1,step=4,phase=forward"], stop_at=8)
    run = tmp_path / "run"
    assert codes == [ExitCode.HANG] * 2, (codes, ranks.output(1)[-3000:])
    resumed = [e for e in events(run) if e.get("event") == "runtime.resume"]
    assert sorted(e["step"] for e in resumed if e["from_checkpoint"]) == [4, 4]  # both ranks
    hang = only_event(run, "hang.detected")
    assert hang["kind"] == "stalled" and hang["ranks"] == [1]
    (named,) = hang["named"]
    assert (named["step"], named["phase"], named["timeout_s"]) == (4, "forward", 4.0)
    assert exit_events(run) == {0: ExitCode.HANG, 1: ExitCode.HANG}
    # the first-step timeout (4 s) + one interval, 2 s of slack on a loaded machine; the
    # start-up allowance (60 s) would have applied to this step before
    latency = timestamp(hang) - fault_time(ranks, 1, "hang")
    assert latency < WATCHDOG["first_step_timeout_s"] + 0.25 + 2, latency
    stacks = (run / "stacks" / "rank1.txt").read_text()
    assert "step 4 phase forward" in stacks and "in fire" in stacks
    dumped = only_event(run, "stacks.dumped")
    assert dumped["rank"] == 1 and len(dumped["children"]) == 2  # its two loader workers
    assert stacks.count("# child pid ") == 2
    assert pid_of(run, 1) not in {c["pid"] for c in dumped["children"]}
