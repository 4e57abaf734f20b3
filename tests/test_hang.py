"""Hang and dead-peer detection with real ranks: 3 gloo processes, one of them in trouble.

Each rank is a plain process (chaos.ranks), so every rank's own exit code is visible;
torchrun would tear the group down itself after the first exit. The faults come from
chaos.inject at a chosen (rank, step, phase). Timeouts are seconds, so each run ends a few
seconds after the fault. Every test asserts that the right rank is named, that every rank
left with the documented exit code, and that no process is left behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import (
    GUARDED_WORKER,
    HANG_WATCHDOG,
    RANKS_WAIT_S,
    exit_events,
    fault_time,
    launch_ranks,
    only_event,
    pid_of,
)

from chaos.procs import Run, events, latest_event
from resilient.events import timestamp
from resilient.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WATCHDOG = HANG_WATCHDOG
WORKER = GUARDED_WORKER
PACE = "slow@phase=step,seconds=0.05"  # every rank: ~0.1 s a step, so heartbeats show steps


def test_sleeping_rank_is_named_dumped_and_everyone_exits(tmp_path: Path) -> None:
    codes, ranks = launch_ranks(
        tmp_path, [PACE, "hang@rank=1,step=6,phase=forward"], "--steps", "20"
    )
    run = tmp_path / "run"
    assert codes == [ExitCode.HANG] * 3, codes
    hang = only_event(run, "hang.detected")
    assert hang["rank"] == 0 and hang["kind"] == "stalled" and hang["ranks"] == [1]
    (named,) = hang["named"]
    assert (named["step"], named["phase"]) == (6, "forward")
    assert named["pid"] == pid_of(run, 1) and named["host"]
    assert exit_events(run) == {0: ExitCode.HANG, 1: ExitCode.HANG, 2: ExitCode.HANG}
    # the sleeper's own stacks, written by its watchdog thread before it exited
    stacks = (run / "stacks" / "rank1.txt").read_text()
    assert named["stacks"] == str(run / "stacks" / "rank1.txt")
    assert "step 6 phase forward" in stacks and "chaos/faults.py" in stacks
    assert "in fire" in stacks  # the main thread, caught sleeping
    # timeout 2 s + one 0.25 s interval; 2 s of slack for a loaded 2-core machine
    latency = timestamp(hang) - fault_time(ranks, 1, "hang")
    assert latency < WATCHDOG["timeout_s"] + 1 + 2, latency


def test_stopped_rank_is_reported_by_peers_and_killed(tmp_path: Path) -> None:
    codes, ranks = launch_ranks(
        tmp_path, [PACE, "stop@rank=1,step=6,phase=forward"], "--steps", "20"
    )
    run = tmp_path / "run"
    assert codes[0] == codes[2] == ExitCode.HANG and codes[1] == -9, codes
    hang = only_event(run, "hang.detected")
    assert hang["kind"] == "no_heartbeat" and hang["ranks"] == [1]
    (named,) = hang["named"]
    assert named["state"] == "stopped" and named["pid"] == pid_of(run, 1)
    assert "SIGSTOP" in named["stacks"] and "cannot" in named["stacks"]
    assert 0 <= named["step"] <= 6  # what its peers last heard from it
    killed = latest_event(run, "watchdog.killed", rank=0)
    assert killed is not None and killed["pid"] == named["pid"]
    latency = timestamp(hang) - fault_time(ranks, 1, "stop")
    assert latency < WATCHDOG["heartbeat_timeout_s"] + 1 + 2, latency


def test_a_stopped_rank_is_named_after_the_learned_heartbeat_timeout(tmp_path: Path) -> None:
    """A fixed heartbeat timeout of 60 s, but rank 0 learns one from the gaps between the
    beats it sees (10 x their p99, 1 s at least): rank 1, stopped in a warm step, is named
    within seconds, saying which timeout fired. Rank 0's detector reads no process state
    before that, so this is the path for a rank on another host."""
    codes, ranks = launch_ranks(
        tmp_path,
        [PACE, "stop@rank=1,step=15,phase=forward"],
        "--steps",
        "40",
        watchdog={"heartbeat_timeout_s": 60.0, "heartbeat_learn_floor_s": 1.0},
    )
    run = tmp_path / "run"
    assert codes[0] == codes[2] == ExitCode.HANG and codes[1] == -9, codes
    hang = only_event(run, "hang.detected")
    assert hang["kind"] == "no_heartbeat" and hang["ranks"] == [1]
    (named,) = hang["named"]
    assert named["heartbeat_timeout_kind"] == "learned", named
    assert 1.0 <= named["heartbeat_timeout_s"] < 15, named
    latency = timestamp(hang) - fault_time(ranks, 1, "stop")
    assert latency < named["heartbeat_timeout_s"] + 1 + 2, latency


@pytest.mark.parametrize("mode", ["micro", "none"])
def test_killed_rank_peers_leave_within_the_heartbeat_timeout(tmp_path: Path, mode: str) -> None:
    """With or without a guard around the step (--mode none: the bare loop, where the peers'
    failed collective escapes the loop), the survivors name the dead rank and exit PEER_LOST,
    not as if the collective's error were their own."""
    faults = [PACE, "kill@rank=1,step=6,phase=forward"]
    codes, ranks = launch_ranks(tmp_path, faults, "--steps", "20", "--mode", mode)
    run = tmp_path / "run"
    assert codes == [ExitCode.PEER_LOST, -9, ExitCode.PEER_LOST], codes
    assert not [e for e in events(run) if e.get("event") == "worker.exception"]
    fault = only_event(run, "fault.detected")
    assert fault["kind"] == "no_heartbeat" and fault["ranks"] == [1]
    assert fault["named"][0]["state"] == "dead"
    assert "gone" in fault["named"][0]["stacks"]
    exits = [e for e in events(run) if e.get("event") == "watchdog.exit"]
    assert {e["rank"] for e in exits} == {0, 2}
    latest = max(timestamp(e) for e in exits)
    assert latest - fault_time(ranks, 1, "kill") < WATCHDOG["heartbeat_timeout_s"] + 1 + 2


def test_rank_stuck_in_a_long_phase_is_named_by_the_monitored_barrier(tmp_path: Path) -> None:
    """Rank 1 sits in `eval`, whose own timeout is long, so the heartbeat monitor waits;
    its peers reach the barrier, which names it after barrier_timeout_s."""
    codes, _ = launch_ranks(
        tmp_path,
        ["hang@rank=1,step=3,phase=eval"],
        "--eval",
        watchdog={
            "barrier_every_steps": 2,
            "barrier_timeout_s": 3,
            "phase_timeouts_s": {"eval": 60},
        },
    )
    run = tmp_path / "run"
    assert codes == [ExitCode.HANG] * 3, codes
    hang = only_event(run, "hang.detected")
    assert hang["kind"] == "barrier" and hang["ranks"] == [1] and hang["rank"] == 0
    assert "failed to pass monitoredBarrier" in hang["reason"]
    assert hang["named"][0]["phase"] == "eval"
    assert "phase eval" in (run / "stacks" / "rank1.txt").read_text()


def test_straggler_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    codes, _ = launch_ranks(
        tmp_path,
        ["slow@rank=2,phase=forward,seconds=0.15"],
        "--steps",
        "24",
        watchdog={"straggler_patience": 3},
    )
    assert codes == [0, 0, 0], codes
    found = [e for e in events(tmp_path / "run") if e.get("event") == "straggler.detected"]
    assert found and {e["straggler"] for e in found} == {2}
    assert found[0]["local_s"] > 2 * found[0]["median_s"]


def test_under_torchrun_a_hang_restarts_the_group(tmp_path: Path) -> None:
    """End to end with the launcher: attempt 0 hangs and exits 81, torchrun restarts the
    group, attempt 1 (faults arm in attempt 0 only) trains to the end."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        "-m",
        "chaos.inject",
        "--fault",
        "hang@rank=2,step=4,phase=forward",
        "--",
        WORKER,
        "--steps",
        "8",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--run-dir",
        str(run_dir),
    ]
    env = {
        "RESILIENT_WATCHDOG": json.dumps(WATCHDOG),
    }
    with Run(cmd, log_path=tmp_path / "torchrun.log", env=env) as launched:
        rc = launched.wait(RANKS_WAIT_S)
        assert rc == 0, launched.output()[-4000:]
    hang = only_event(run_dir, "hang.detected")
    assert hang["ranks"] == [2] and hang["restart"] == 0
    assert "step 4 phase forward" in (run_dir / "stacks" / "rank2.txt").read_text()
    done = latest_event(run_dir, "runtime.done", rank=0)
    assert done is not None and done["restart"] == 1 and done["step"] == 8


LEARN = {
    "timeout_s": 60.0,
    "startup_timeout_s": 90.0,
    "checkpoint_timeout_s": 90.0,
    "learn_warmup_steps": 5,
    "learn_floor_s": 1.0,
    "learn_factor": 4.0,
}


def test_a_stall_after_the_warm_up_is_named_in_the_learned_timeout(tmp_path: Path) -> None:
    """Fixed timeout 60 s; after 5 warm steps the phases' timeouts are learned (the 1 s
    floor here), agreed by every rank, and a sleeper is named in about that, saying so."""
    codes, ranks = launch_ranks(
        tmp_path, [PACE, "hang@rank=1,step=40,phase=forward"], "--steps", "60", watchdog=LEARN
    )
    run = tmp_path / "run"
    assert codes == [ExitCode.HANG] * 3, codes
    hang = only_event(run, "hang.detected")
    assert hang["kind"] == "stalled" and hang["ranks"] == [1]
    (named,) = hang["named"]
    assert named["timeout_kind"] == "learned" and 1.0 <= named["timeout_s"] < 5, named
    latency = timestamp(hang) - fault_time(ranks, 1, "hang")
    assert latency < named["timeout_s"] + 0.25 + 2, latency  # not the fixed 60 s
    learned = latest_event(run, "hang.timeouts", rank=0)
    assert learned is not None and learned["timeouts_s"]["forward"] == 1.0


@pytest.mark.extended  # 20 s; tests/test_learned.py checks the table's round trip in CI
def test_a_resumed_group_judges_by_the_checkpoints_learned_timeouts(tmp_path: Path) -> None:
    """The first run learns and saves at step 50; the resumed one, whose own warm-up (80
    steps) is far off, names a stall 3 steps after its first with the checkpoint's table."""
    codes, _ = launch_ranks(tmp_path, [PACE], "--steps", "90", "--stop-at", "50", watchdog=LEARN)
    assert codes == [0, 0, 0], codes
    saved = latest_event(tmp_path / "run", "hang.timeouts", rank=0)
    assert saved is not None and saved["timeouts_s"]["forward"] == 1.0
    again = tmp_path / "again"
    again.mkdir()
    (again / "ckpt").symlink_to(tmp_path / "ckpt")
    codes, _ = launch_ranks(
        again,
        [PACE, "hang@rank=2,step=53,phase=forward"],
        "--steps",
        "90",
        watchdog={**LEARN, "learn_warmup_steps": 80},
    )
    assert codes == [ExitCode.HANG] * 3, codes
    (named,) = only_event(again / "run", "hang.detected")["named"]
    assert (named["rank"], named["step"]) == (2, 53)
    assert named["timeout_kind"] == "learned" and named["timeout_s"] == 1.0, named
