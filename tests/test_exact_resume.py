"""Exact resume, end to end: real torchrun runs of the recipes on 2 CPU ranks.

2k steps straight vs k steps, every process gone, then k more in fresh processes: the full
model and optimizer state must be bit-for-bit equal. The same after a kill -9 of one rank
under torchrun --max-restarts, and for DDP on 3 ranks, where a different gradient-bucket
layout in the resumed process's first step would change gloo's sums (resilient.groups.ddp).
A small corpus makes the runs cross an epoch boundary.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import pytest

from chaos.procs import REPO, Run, events, latest_event, torchrun_cmd, wait_for
from resilient.envvars import ENV_WATCHDOG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

K = 12  # steps per half; the corpus below gives 19 steps per epoch, so 2K crosses one
COMMON = ["--corpus-chars", "20000", "--batch-size", "8", "--save-every", "4", "--log-every", "1"]
# A stalled rank is named, its stacks dumped and the group restarted after a minute, not after
# the production defaults' 15 minutes of start-up allowance: far above these runs' steps and
# start-up, and far below the tests' own timeouts.
WATCHDOG = {"timeout_s": 60.0, "startup_timeout_s": 60.0}


def _run(
    recipe: str,
    out: Path,
    stop_at: int,
    *,
    workers: int = 0,
    max_restarts: int = 0,
    k: int = K,
    nproc: int = 2,
) -> Run:
    """A 2k-step schedule on `nproc` ranks that leaves after `stop_at` steps."""
    args = [
        *COMMON,
        "--steps",
        str(2 * k),
        "--stop-at",
        str(stop_at),
        "--workers",
        str(workers),
        "--ckpt-dir",
        str(out / "ckpt"),
        "--run-dir",
        str(out / "run"),
    ]
    return Run(
        torchrun_cmd(REPO / "recipes" / recipe, args, nproc=nproc, max_restarts=max_restarts),
        log_path=out / f"stdout-{stop_at}.log",
        env={"PYTHONUNBUFFERED": "1", ENV_WATCHDOG: json.dumps(WATCHDOG)},
    )


def _finish(run: Run, timeout: float = 180) -> None:
    with run:
        rc = run.wait(timeout)
        assert rc == 0, f"exit code {rc}\n{run.output()[-4000:]}"


def _digest(out: Path) -> dict[str, object]:
    return json.loads((out / "run" / "final_digest.json").read_text())


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Uninterrupted 2K-step runs, one per recipe and worker count."""
    out: dict[str, dict[str, object]] = {}
    for recipe, workers in (("train_ddp.py", 2), ("train_fsdp.py", 0)):
        d = tmp_path_factory.mktemp(f"golden-{recipe}")
        _finish(_run(recipe, d, 2 * K, workers=workers))
        out[recipe] = _digest(d)
    return out


@pytest.mark.parametrize(("recipe", "workers"), [("train_ddp.py", 2), ("train_fsdp.py", 0)])
def test_stop_and_resume_is_bit_exact(recipe: str, workers: int, golden: dict, tmp_path: Path):
    _finish(_run(recipe, tmp_path, K, workers=workers))
    first = _digest(tmp_path)
    assert first["step"] == K
    _finish(_run(recipe, tmp_path, 2 * K, workers=workers))
    resumed = latest_event(
        tmp_path / "run", "runtime.resume", rank=0, where=lambda e: e["from_checkpoint"]
    )
    assert resumed is not None and resumed["step"] == K
    final = _digest(tmp_path)
    assert final["step"] == 2 * K
    assert final["digest"] == golden[recipe]["digest"]
    assert first["digest"] != final["digest"]  # the second half did train


def test_kill_9_one_rank_under_torchrun_restart_is_bit_exact(golden: dict, tmp_path: Path):
    run = _run("train_ddp.py", tmp_path, 2 * K, workers=2, max_restarts=2)
    run_dir = tmp_path / "run"
    with run:
        committed = wait_for(
            lambda: latest_event(
                run_dir, "ckpt.save.committed", rank=1, where=lambda e: e["step"] >= 8
            ),
            timeout=120,
            what="a committed checkpoint at step >= 8",
        )
        victim = latest_event(run_dir, "runtime.init", rank=1)
        assert victim is not None
        os.kill(victim["pid"], signal.SIGKILL)
        rc = run.wait(180)
        assert rc == 0, run.output()[-4000:]
    # Seen once in a clean CI run (2026-11-22): the restarted group stalled in its first step
    # (with 2 loader workers per rank) and no cause could be found without stacks. Such a
    # stall now ends in a restart; say so, with where its stacks went, without failing.
    for hang in (e for e in events(run_dir) if e.get("event") == "hang.detected"):
        warnings.warn(f"a stall was detected and restarted: {hang}", stacklevel=1)
    # the restarted group resumed from a committed checkpoint, no older than the one seen
    resumed = latest_event(run_dir, "runtime.resume", rank=0, where=lambda e: e["restart"] == 1)
    assert resumed is not None and resumed["from_checkpoint"]
    assert resumed["step"] >= committed["step"]
    assert resumed["step"] % 4 == 0
    assert _digest(tmp_path)["digest"] == golden["train_ddp.py"]["digest"]


@pytest.mark.extended  # 22 s: make soak; CI resumes 2-rank DDP and FSDP2 bit for bit
@pytest.mark.timeout(300)  # three launches of 3 ranks on a small machine
def test_ddp_on_3_ranks_stop_and_resume_is_bit_exact(tmp_path: Path):
    # DDP reduces a process's first step in one bucket, later ones in rebuilt buckets; on 3
    # ranks the two layouts sum in different orders. Step k is the resumed process's first.
    k = 4
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _finish(_run("train_ddp.py", straight, 2 * k, k=k, nproc=3))
    _finish(_run("train_ddp.py", stopped, k, k=k, nproc=3))
    first = _digest(stopped)
    _finish(_run("train_ddp.py", stopped, 2 * k, k=k, nproc=3))
    resumed = latest_event(
        stopped / "run", "runtime.resume", rank=0, where=lambda e: e["from_checkpoint"]
    )
    assert resumed is not None and resumed["step"] == k
    final = _digest(stopped)
    assert final["step"] == 2 * k and final["world_size"] == 3
    assert final["digest"] == _digest(straight)["digest"]
    assert first["digest"] != final["digest"]  # the second half did train
    pinned = latest_event(stopped / "run", "ddp.buckets", rank=2)
    assert pinned is not None and pinned["outcome"] == "pinned"
