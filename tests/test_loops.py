"""Loops as people write them, ported to resilient and checked bit for bit under real faults.

- PyTorch's DDP tutorial (an epoch loop over a DataLoader), ported in at most 10 lines, under
  kill -9, SIGSTOP and SIGTERM in one run: the final state equals the fault-free run's.
- A nanoGPT-shaped step loop (batches sampled with the global RNG, dropout, gradient
  accumulation with `no_sync`) under kill -9.
Faults at exact steps come from chaos.inject (real signals sent by the rank to itself); the
preemption is a SIGTERM to the launcher. Both ranks' replayed steps must be verified.
"""

from __future__ import annotations

import difflib
import json
import signal
import sys
from pathlib import Path

import pytest

from chaos.procs import REPO, Run, torchrun_cmd, wait_for
from resilient import events as ev
from resilient.envvars import ENV_FINAL_DIGEST, ENV_PREEMPT, ENV_WATCHDOG

WORKERS = REPO / "tests" / "workers"
TUTORIAL = WORKERS / "tutorial_ddp.py"
GPT = WORKERS / "gpt_style.py"
ENV = {
    "PYTHONUNBUFFERED": "1",
    ENV_FINAL_DIGEST: "1",
    # a stopped rank is found by its peers in seconds, not the production minutes
    ENV_WATCHDOG: json.dumps(
        {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 5.0, "timeout_s": 10.0}
    ),
    ENV_PREEMPT: json.dumps({"check_interval_s": 0.1}),
}


def _code(path: Path) -> list[str]:
    """The file's lines without its module docstring and blank lines."""
    text = path.read_text()
    body = text.split('"""', 2)[2] if text.startswith('"""') else text
    return [line.rstrip() for line in body.splitlines() if line.strip()]


def test_the_tutorial_port_adds_or_changes_at_most_10_lines() -> None:
    diff = difflib.ndiff(_code(WORKERS / "tutorial_original.py"), _code(TUTORIAL))
    added = [line[2:] for line in diff if line.startswith("+ ")]
    assert len(added) <= 10, "\n".join(added)
    assert all("resilient" in line for line in added), added


def _digest(run_dir: Path) -> str:
    found = {e["rank"]: e["digest"] for e in ev.read_events(run_dir, ev.RUNTIME_DIGEST)}
    assert len(set(found.values())) == 1, found  # every rank sees one state
    return str(found[0])


def _finish(run: Run, timeout: float = 120) -> None:
    with run:
        rc = run.wait(timeout)
        assert rc == 0, f"exit code {rc}\n{run.output()[-4000:]}"


def _fresh_digest(tmp: Path, cmd: list[str], env: dict[str, str] | None = None) -> str:
    _finish(Run(cmd, log_path=tmp / "golden.log", env={**ENV, **(env or {})}))
    return _digest(tmp / "golden-run")


def _verified(run_dir: Path) -> list[dict[str, object]]:
    assert ev.read_events(run_dir, ev.RESUME_DIVERGED) == []
    return ev.read_events(run_dir, ev.RESUME_VERIFIED)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tutorial_epoch_loop_is_exact_under_kill_sigstop_and_sigterm(tmp_path: Path) -> None:
    """30 steps: 5 epochs of 6 batches of 0.1 s, saved (async) every epoch. Attempt 0: rank 1
    SIGKILLs itself in step 10 (epoch 1); attempt 1 resumes at 6 (or 0 if that save had not
    committed yet) and rank 0 SIGSTOPs itself in step 16; its peer finds it, attempt 2
    resumes at 12 (or 6), and when it reached step 18 the launcher gets SIGTERM: the ranks
    agree on a step, save it and exit 85. The next launch finishes the run."""
    args = ["5", "1"]
    golden = _fresh_digest(
        tmp_path,
        torchrun_cmd(TUTORIAL, [*args, "--snapshot_path", str(tmp_path / "golden-ckpt")]),
        {"RESILIENT_RUN_DIR": str(tmp_path / "golden-run")},
    )
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    launch = [
        sys.executable,
        "-m",
        "resilient.cli",
        "run",
        "--nproc-per-node=2",
        "--max-restarts=3",
        f"--run-dir={run_dir}",
        f"--checkpoint-url={ckpt}",
    ]
    script = [str(TUTORIAL), *args, "--snapshot_path", str(ckpt)]
    faults = [
        "kill@rank=1,step=10",
        "stop@rank=0,step=16,restart=1",
        "slow@phase=forward,seconds=0.1,restart=any",
    ]
    injected = ["-m", "chaos.inject", *(f"--fault={f}" for f in faults), "--", *script]
    with Run([*launch, *injected], log_path=tmp_path / "first.log", env=ENV) as run:
        wait_for(
            lambda: ev.latest_event(
                run_dir, ev.STEP_FINGERPRINT, 0, lambda e: e["restart"] == 2 and e["step"] >= 18
            ),
            timeout=200,
            what="step 18 in the third attempt",
        )
        run.proc.send_signal(signal.SIGTERM)
        rc = run.wait(90)
        assert rc == 85, run.output()[-4000:]
    _finish(Run([*launch, *script], log_path=tmp_path / "second.log", env=ENV))
    resumes = [e["step"] for e in ev.read_events(run_dir, ev.RUNTIME_RESUME, rank=0)]
    assert len(resumes) == 4 and resumes[1] in (0, 6) and resumes[2] in (6, 12), resumes
    assert resumes[3] >= 18, resumes  # the preemption saved the step it stopped at
    assert _digest(run_dir) == golden
    verified = _verified(run_dir)  # the replay after the stop at least, on both ranks
    assert {e["rank"] for e in verified if int(e["steps"]) >= 1} == {0, 1}, verified
    # the script configured structlog and logging itself: the rank logs are written anyway
    assert (run_dir / "logs" / "rank1.jsonl").stat().st_size > 0
    assert len(ev.read_events(run_dir, ev.PREEMPT_EXIT)) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sampling_loop_with_no_sync_accumulation_is_exact_under_kill_9(tmp_path: Path) -> None:
    """Global-RNG batch sampling, dropout, two micro-steps under `no_sync`; saved every 3
    steps. Rank 1 SIGKILLs itself in step 7; the restart resumes at 6 and replays step 6."""
    args = ["--steps", "12", "--sync", "no_sync"]
    golden = _fresh_digest(
        tmp_path,
        torchrun_cmd(GPT, args),
        {
            "RESILIENT_RUN_DIR": str(tmp_path / "golden-run"),
            "RESILIENT_CHECKPOINT_DIR": str(tmp_path / "golden-ckpt"),
        },
    )
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(
        "chaos.inject",
        ["--fault=kill@rank=1,step=7", "--", str(GPT), *args],
        max_restarts=1,
        extra=["-m"],
    )
    env = {
        **ENV,
        "RESILIENT_RUN_DIR": str(run_dir),
        "RESILIENT_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    _finish(Run(cmd, log_path=tmp_path / "faulty.log", env=env))
    assert _digest(run_dir) == golden
    assert sorted((e["rank"], e["steps"]) for e in _verified(run_dir)) == [(0, 1), (1, 1)]
