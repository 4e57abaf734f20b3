"""A launcher killed -9 takes its workers with it (resilient/worker.py, _die_with_the_launcher).

Under `--hot-recovery` every worker, and the warm spare, runs under the worker wrapper. With
the launcher gone a worker has nobody to restart it, and before this a worker outside a
generation (a replacement in the script's own init_process_group) waited out that call's 30
minutes; one in training exited only when its watchdog found the store gone (about 20 s,
measured). Here the launcher is SIGKILLed while its two workers train and save: they and the
spare are gone within seconds (a save cut short is never committed: test_checkpoint.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import kill_tree, run_cmd, run_events, spawn, tiny_ddp_loop, wait_for

from resilient.proctree import alive, descendants

_SCRIPT = tiny_ddp_loop(steps=100000, sleep_s=0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_and_the_spare_die_with_a_launcher_killed_9(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT)
    run = tmp_path / "run"
    cmd = run_cmd(
        "--nproc-per-node=2",
        f"--run-dir={run}",
        f"--checkpoint-url={tmp_path / 'ckpt'}",
        "--hot-recovery",
        str(script),
    )
    env = {"RESILIENT_SNAPSHOT": json.dumps({"enabled": True, "every_steps": 1})}
    launcher = spawn(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs: list[int] = []
    try:
        wait_for(lambda: len(run_events(run, "ckpt.save.committed")) >= 4, timeout=90, what="saves")
        procs = descendants(launcher.pid)
        workers = {int(e["pid"]) for e in run_events(run, "runtime.init")}
        assert len(workers) == 2 and workers <= set(procs), (workers, procs)
        assert len(procs) >= 3, procs  # the two workers and the spare (and its helpers)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        t0 = time.monotonic()
        wait_for(lambda: not [p for p in procs if alive(p)], timeout=10, what="its processes' end")
        gone_s = time.monotonic() - t0
    finally:
        kill_tree(launcher.pid, groups=(launcher.pid,))
        for pid in procs:
            kill_tree(pid, groups=(pid,))
    assert gone_s < 3, f"its workers outlived the launcher by {gone_s:.1f} s"
