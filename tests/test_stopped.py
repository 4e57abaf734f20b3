"""A stopped worker named by its node's agent in seconds (resilient/supervisor/stopped.py), not
after the workers' heartbeat timeout (30 s here): under `resilient run`, chaos.inject SIGSTOPs
rank 1 at step 5; the agent reads /proc, publishes the verdict, kills the worker, and the
group recovers (hot, or cold with --max-restarts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import GUARDED_STEPS, GUARDED_WATCHDOG, GUARDED_WORKER, Launcher, run_cmd, run_events

from resilient.events import timestamp
from resilient.proctree import alive
from resilient.report import analyze
from resilient.supervisor.stopped import StoppedWorkers, proc_state

pytestmark = [pytest.mark.timeout(180)]


def test_proc_state_reads_stopped_running_and_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # D: a process just started may wait on the disk (a CI run here, beside a build)
        assert proc_state(child.pid) in ("R", "S", "D")
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while proc_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait(10)
    assert proc_state(child.pid) is None


def _run(out: Path, *extra: str) -> tuple[int, str]:
    argv = [*extra, "--nproc-per-node", "2", "--run-dir", str(out / "run")]
    argv += ["--monitor-interval", "0.05", "-m", "chaos.inject"]
    argv += ["--fault", "stop@rank=1,step=5,phase=forward", "--", GUARDED_WORKER]
    argv += ["--mode", "micro", "--steps", str(GUARDED_STEPS), "--workers", "0"]
    argv += ["--ckpt-dir", str(out / "ckpt"), "--run-dir", str(out / "run")]
    watchdog = {**GUARDED_WATCHDOG, "heartbeat_timeout_s": 30.0, "timeout_s": 60.0}
    env = {"RESILIENT_WATCHDOG": json.dumps(watchdog)}
    if "--hot-recovery" in extra:
        env["RESILIENT_SNAPSHOT"] = json.dumps({"enabled": True, "every_steps": 1})
    launcher = Launcher()
    try:
        code, _, err = launcher.run(run_cmd(*argv), timeout=150, env=env)
    finally:
        launcher.close()
    pids = {int(e["pid"]) for e in run_events(out / "run", "runtime.init")}
    assert not [p for p in pids if alive(p)], "processes left behind"
    return code, err


def _detected_in(out: Path) -> float:
    """Seconds from the SIGSTOP to the agent's verdict, which names rank 1 as stopped."""
    (hang,) = run_events(out / "run", "hang.detected")
    assert hang["by"] == "agent" and hang["ranks"] == [1] and hang["kind"] == "no_heartbeat"
    (named,) = hang["named"]
    assert named["state"] == "stopped" and named["step"] <= 5, named
    (fault,) = run_events(out / "run", "chaos.fault")
    return timestamp(hang) - timestamp(fault)


@pytest.mark.slow
def test_a_stopped_rank_is_named_in_seconds_and_replaced_hot(tmp_path: Path) -> None:
    code, err = _run(tmp_path, "--hot-recovery")
    assert code == 0, err[-3000:]
    assert _detected_in(tmp_path) < 3.0
    (replace,) = run_events(tmp_path / "run", "recovery.hot.replace")
    assert (replace["rank"], replace["exit_code"]) == (1, -9)
    assert not run_events(tmp_path / "run", "recovery.cold")
    (fault,) = analyze(tmp_path / "run").faults  # resilient report
    assert (fault.kind, fault.recovery, fault.timeout) == (
        "stop",
        "hot replacement",
        "process state",
    )
    assert fault.detect_s is not None and fault.detect_s < 3.0


@pytest.mark.extended
def test_a_stopped_rank_is_named_in_seconds_and_the_group_restarts(tmp_path: Path) -> None:
    code, err = _run(tmp_path, "--max-restarts", "1")
    assert code == 0, err[-3000:]
    assert _detected_in(tmp_path) < 3.0
    assert len(run_events(tmp_path / "run", "attempt.start")) == 2


class _Worker:
    def __init__(self, local_rank: int, global_rank: int) -> None:
        self.local_rank, self.global_rank, self.world_size = local_rank, global_rank, 4


class _Group:
    def __init__(self, *workers: _Worker) -> None:
        self.workers = list(workers)


def test_the_agent_names_a_stopped_worker_in_the_workers_store_once() -> None:
    """StoppedWorkers as a unit: a stopped child (global rank 3) gets the verdict the
    watchdog would write, claimed first, and is killed; a running one is left alone; the
    claim is not taken twice."""
    import torch.distributed as dist

    store = dist.HashStore()
    said: list[tuple[str, dict]] = []
    watch = StoppedWorkers(
        lambda _g: (store, "pre/watchdog"),
        lambda event, **f: said.append((event, f)),
        hot=lambda: True,
        after_s=0.0,
    )
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    stopped = subprocess.Popen(sleeper, start_new_session=True)
    running = subprocess.Popen(sleeper, start_new_session=True)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while proc_state(stopped.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        group = _Group(_Worker(0, 2), _Worker(1, 3))
        watch.look(group, {0: running.pid, 1: stopped.pid})  # type: ignore[arg-type]
        watch.look(group, {0: running.pid, 1: stopped.pid})  # type: ignore[arg-type]
        assert stopped.wait(5) == -signal.SIGKILL and running.poll() is None
        verdict = json.loads(store.get("pre/watchdog/verdict"))
        assert (verdict["ranks"], verdict["kind"], verdict["code"]) == ([3], "no_heartbeat", 81)
        assert verdict["hot"] is True and verdict["expect_acks"] == 3
        assert verdict["named"][0]["state"] == "stopped" and store.add("pre/watchdog/claim", 0) == 1
        assert [e for e, _ in said] == ["hang.detected", "watchdog.killed"]
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait(10)
