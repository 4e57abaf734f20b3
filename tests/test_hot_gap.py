"""A survivor stuck on its way out of its generation (hot/gapwatch.py).

Between a peer's loss and the next roll call a survivor runs no watchdog, and the others'
roll call would wait for it until the start-up timeout (15 minutes by default). Here rank 0,
the survivor of rank 1's kill -9, blocks in C holding the GIL (as a gloo destructor can) just
after it left generation 0. Its own faulthandler timer writes its stacks and ends it after
GAP_S; the agent restarts the group cold, which resumes from storage and ends 0."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import Launcher, recipe_cmd, run_events, tiny_ddp_loop

from resilient.exitcodes import ExitCode
from resilient.hot.recovery import GAP_S

_SCRIPT = tiny_ddp_loop(steps=24, sleep_s=0.05)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_survivor_blocked_after_it_left_dumps_its_stacks_and_the_group_goes_cold(
    tmp_path: Path, launcher: Launcher
) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT)
    faults = ("kill@rank=1,step=12,phase=step", "freeze@rank=0,phase=left,generation=1")
    cmd = recipe_cmd(str(script), tmp_path, "--hot-recovery", faults=faults)
    env = {
        "RESILIENT_WATCHDOG": '{"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3}',
        "RESILIENT_SNAPSHOT": '{"enabled": true, "every_steps": 1}',
    }
    t0 = time.monotonic()
    code, _, err = launcher.run(cmd, timeout=170, env=env)
    took = time.monotonic() - t0
    assert code == ExitCode.OK, err[-4000:]
    run = tmp_path / "run"
    stacks = (run / "stacks" / "rank0.txt").read_text()
    assert "leaving for hot generation 1" in stacks, stacks
    assert "Timeout (0:00:35)!" in stacks, stacks  # faulthandler's own line
    assert "chaos/faults.py" in stacks and "in fire" in stacks, stacks  # where it blocked
    (cold,) = [e for e in run_events(run, "recovery.cold") if "forming" in e["reason"]]
    assert cold["rank"] == 0 and cold["exit_code"] == 1, cold
    (detect,) = [e for e in run_events(run, "recovery.hot.detect") if e["rank"] == 0]
    waited = _epoch(cold["ts"]) - _epoch(detect["ts"])
    assert GAP_S <= waited < GAP_S + 10, f"named {waited:.1f} s after the survivor left"
    assert len(run_events(run, "attempt.start")) == 2  # one cold restart, then to the end
    assert took < 150, f"{took:.0f} s"


def _epoch(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
