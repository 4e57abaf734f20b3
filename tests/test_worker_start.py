"""A loader worker stuck in its own fork is named in seconds (resilient/data/worker_start.py).

On CPython before 3.10.15 and 3.11.10 a forked child can deadlock before it runs a line of
Python (CPython gh-112275), and its rank then waits for the worker's first batch for ever. Two
real gloo ranks with two loader workers each: chaos makes the first child that rank 1 forks in
step 0 (a loader worker) sleep in an at-fork hook, before it starts, as a deadlocked one would.
The first-step timeout is 60 s; the stuck worker must be named after `worker_start_timeout_s`
(3 s) instead, killed, and every rank must exit with ExitCode.HANG.

The in-process tests fork loader workers from the pytest process: `solo`, as in
tests/test_loader_workers.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import assert_no_process_left, exit_events, fault_time, mark_worker, only_event
from torchdata.stateful_dataloader import StatefulDataLoader

from chaos.procs import events
from chaos.ranks import Ranks
from resilient.data import worker_start
from resilient.data.worker_start import WorkerStarts, fork_deadlock_prone, forks_workers
from resilient.events import timestamp
from resilient.exitcodes import ExitCode

WATCHDOG = {
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 2.0,
    "timeout_s": 2.0,
    "first_step_timeout_s": 60.0,
    "startup_timeout_s": 120.0,
    "worker_start_timeout_s": 3.0,
}
WORKER = "tests/workers/guarded_train.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not fork_deadlock_prone(), reason="this interpreter has CPython's fix")
def test_a_worker_stuck_in_its_fork_is_named_in_seconds(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = ["-m", "chaos.inject", "--fault", "fork_stall@rank=1,step=0,phase=data", "--"]
    argv += [WORKER, "--mode", "none", "--workers", "2", "--steps", "8"]
    argv += ["--ckpt-dir", str(tmp_path / "ckpt"), "--run-dir", str(run)]
    ranks = Ranks(
        2, argv, log_dir=tmp_path / "out", env={"RESILIENT_WATCHDOG": json.dumps(WATCHDOG)}
    )
    try:
        codes = ranks.wait(150)
        assert_no_process_left(ranks, run)
    finally:
        ranks.kill()
    assert codes == [ExitCode.HANG] * 2, (codes, ranks.output(1)[-3000:])
    warned = [e for e in events(run) if e.get("event") == "data.fork_deadlock_prone"]
    assert sorted(e["rank"] for e in warned) == [0, 1] and "gh-112275" in warned[0]["fix"]
    hang = only_event(run, "hang.detected")
    assert hang["kind"] == "stalled" and hang["ranks"] == [1], hang
    (named,) = hang["named"]
    assert (named["step"], named["phase"]) == (0, "data"), named
    assert (named["timeout_kind"], named["timeout_s"]) == ("worker_start", 3.0), named
    (stuck,) = named["stuck_workers"]
    assert "stuck in their fork" in hang["reason"] and str(stuck) in hang["reason"]
    assert not psutil.pid_exists(stuck) or psutil.Process(stuck).status() == "zombie"
    assert exit_events(run) == {0: ExitCode.HANG, 1: ExitCode.HANG}
    # 3 s after the fork, one interval, 3 s of slack on a loaded machine: not the 60 s
    latency = timestamp(hang) - fault_time(ranks, 1, "fork_stall")
    assert latency < WATCHDOG["worker_start_timeout_s"] + 0.25 + 3, latency
    assert "stuck in their fork" in (run / "stacks" / "rank1.txt").read_text()


def test_the_affected_interpreters() -> None:
    for version, prone in [
        ((3, 10, 14), True),
        ((3, 10, 15), False),
        ((3, 11, 7), True),
        ((3, 11, 9), True),
        ((3, 11, 10), False),
        ((3, 12, 0), False),
        ((3, 13, 1), False),
    ]:
        assert fork_deadlock_prone(version) is prone, version


@pytest.mark.solo
@pytest.mark.timeout(60)
def test_started_workers_are_not_stuck() -> None:
    """A loader's workers write their pids as they start, through a wrapper around the
    user's own worker_init_fn."""
    data = list(range(16))
    loader = StatefulDataLoader(data, batch_size=2, num_workers=2, worker_init_fn=mark_worker)
    assert forks_workers(loader)
    starts = WorkerStarts(loader)
    try:
        since = time.time()
        it = iter(loader)
        assert [int(x) for x in next(it)] == [0, 1]
        pids = {w.pid for w in it._workers}  # type: ignore[attr-defined]
        time.sleep(0.1)
        assert starts.stuck(since, 0.0) == []  # both started: nothing is stuck
        assert pids <= set(starts.started)
        assert starts.stuck(None, 0.0) == []  # outside iter(): never
        del it
    finally:
        starts.close()


def test_only_forked_workers_are_watched() -> None:
    assert not forks_workers(StatefulDataLoader(list(range(4)), num_workers=0))
    spawn = StatefulDataLoader(list(range(4)), num_workers=2, multiprocessing_context="spawn")
    assert not forks_workers(spawn)
    fork = StatefulDataLoader(list(range(4)), num_workers=2, multiprocessing_context="fork")
    assert forks_workers(fork)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's start times")
@pytest.mark.timeout(30)
def test_a_child_forked_now_is_born_now() -> None:
    """A child's start time and the wall clock agree to the kernel's tick. psutil's
    create_time() is up to 1 s early (a boot time in whole seconds): a fork 50 ms after the
    iterator began then looked older than the iterator, and the stuck worker went unnamed
    until the phase's timeout on machines that booted late in a second."""
    for _ in range(5):
        before = worker_start._since_boot()
        child = subprocess.Popen(["sleep", "5"])
        try:
            born = worker_start._born_since_boot(psutil.Process(child.pid))
            after = worker_start._since_boot()
        finally:
            child.kill()
            child.wait()
        assert before - 0.02 <= born <= after + 0.02, (before, born, after)
