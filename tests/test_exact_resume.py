"""Exact resume, end to end: real torchrun runs of the recipes on 2 CPU ranks.

2k steps straight vs k steps, every process gone, then k more in fresh processes: the full
model and optimizer state must be bit-for-bit equal. The same after a kill -9 of one rank
under torchrun --max-restarts (in the DDP run's second half), and for DDP on 3 ranks, where a
different gradient-bucket layout in the resumed process's first step would change gloo's
sums (resilient.groups.ddp).
A small corpus makes the runs cross an epoch boundary.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from chaos.launch import golden as chaos_golden
from chaos.procs import REPO, Run, events, latest_event, torchrun_cmd, wait_for
from chaos.scenario import Scenario
from resilient.envvars import ENV_WATCHDOG

# new interpreters, each importing torch and drawing its own hash seed: the real start path,
# compared bitwise with the goldens, which the session's fork servers ran (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.fresh_interpreters]

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
def golden(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, object]]:
    """`golden(recipe)`: the uninterrupted 2K-step run of the recipe, the chaos harness's
    fault-free run of the same schedule (chaos/launch.py), computed once for the session
    under the directory tests/test_chaos.py's matrix uses, which compares its DDP scenarios
    with the same run. It uses no loader workers: a resumed run with two per rank must still
    end on its bits (the workers change what runs where, never which samples a step sees)."""
    cache = tmp_path_factory.getbasetemp() / "chaos" / "golden"

    def get(recipe: str) -> dict[str, object]:
        return chaos_golden(Scenario(name="golden", recipe=recipe, steps=2 * K), cache)

    return get


@pytest.mark.parametrize(
    ("recipe", "workers", "kill"), [("train_ddp.py", 2, True), ("train_fsdp.py", 0, False)]
)
def test_stop_and_resume_is_bit_exact(
    recipe: str, workers: int, kill: bool, golden: Callable, tmp_path: Path
):
    """k steps, every process gone, then k more in fresh processes. With DDP the second
    launch also loses rank 1 to a kill -9 in its first steps, under torchrun --max-restarts:
    the restarted group resumes from a committed checkpoint, and the run still ends on the
    golden bits (one launch does both: the kill once had a 2k-step launch of its own)."""
    _finish(_run(recipe, tmp_path, K, workers=workers))
    first = _digest(tmp_path)
    assert first["step"] == K
    second = _run(recipe, tmp_path, 2 * K, workers=workers, max_restarts=2 if kill else 0)
    committed = _kill_rank_1_once_it_trains_again(second, tmp_path / "run") if kill else None
    _finish(second)
    resumed = latest_event(
        tmp_path / "run",
        "runtime.resume",
        rank=0,
        where=lambda e: e["from_checkpoint"] and e["restart"] == 0,
    )
    assert resumed is not None and resumed["step"] == K
    final = _digest(tmp_path)
    assert final["step"] == 2 * K
    assert final["digest"] == golden(recipe)["digest"]
    assert first["digest"] != final["digest"]  # the second half did train
    if committed is not None:
        _check_the_restart_after_the_kill(tmp_path / "run", committed)


def _kill_rank_1_once_it_trains_again(run: Run, run_dir: Path) -> dict:
    """SIGKILL rank 1 of the second launch once it has stepped past the resume point (the
    steps before K ran in the first launch); returns the newest checkpoint committed then."""
    try:
        wait_for(
            lambda: latest_event(
                run_dir, "step.fingerprint", rank=1, where=lambda e: e["step"] > K
            ),
            timeout=120,
            what=f"rank 1 stepping past step {K} again",
        )
        committed = latest_event(run_dir, "ckpt.save.committed", rank=1)
        assert committed is not None and committed["step"] >= K
        victim = latest_event(run_dir, "runtime.init", rank=1)
        assert victim is not None
        os.kill(victim["pid"], signal.SIGKILL)
    except BaseException:
        run.kill()
        raise
    return committed


def _check_the_restart_after_the_kill(run_dir: Path, committed: dict) -> None:
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
