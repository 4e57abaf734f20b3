"""`resilient run`: command line, restart policy, failure reports and crash-loop detection."""

from __future__ import annotations

import ast
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tenacity
from helpers import (
    SUPERVISED_WORKER,
    ForkedCli,
    Launcher,
    last_by_step,
    records,
    run_cmd,
    run_events,
)

from resilient.backoff import ExponentialJitter
from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode, describe
from resilient.supervisor.config import DEFAULT_MAX_RESTARTS, UsageError, parse_command_line
from resilient.supervisor.policy import RestartPolicy, RestartTracker
from resilient.supervisor.procs import peek_exit
from resilient.supervisor.report import (
    AttemptRecord,
    EventLogs,
    RankFailure,
    explain_failures,
    repeating_failure,
)

# ---------------------------------------------------------------------- the contract

REPO = Path(__file__).resolve().parent.parent


def _resilient_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return {n for n in names if n.startswith("resilient")}


def test_supervisor_and_runtime_meet_only_through_the_contract() -> None:
    for side, other in (("supervisor", "runtime"), ("runtime", "supervisor")):
        for path in sorted((REPO / "resilient" / side).glob("*.py")):
            crossing = {m for m in _resilient_imports(path) if m.startswith(f"resilient.{other}")}
            assert not crossing, f"{path.name} imports {crossing}: use resilient.envvars"


def test_the_launcher_loads_neither_the_worker_runtime_nor_dcp() -> None:
    code = (
        "import sys, resilient.cli, resilient.supervisor.launcher, resilient.envvars\n"
        "print(sorted(m for m in sys.modules if m.startswith(('resilient.runtime', "
        "'resilient.checkpoint', 'torch.distributed.checkpoint'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- restart policy


def test_backoff_doubles_within_jitter_and_ceiling() -> None:
    p = RestartPolicy(backoff_s=1.0, backoff_max_s=5.0, jitter_s=0.5)
    assert p.delay(0) == 0.0
    for streak, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0)]:
        d = p.delay(streak)
        assert base <= d <= base + 0.5, (streak, d)
    assert RestartPolicy(backoff_s=0, jitter_s=0).delay(3) == 0.0


def test_backoff_draws_from_its_own_rng_and_fits_tenacity() -> None:
    """The global `random` state is part of a checkpoint: a restart's jitter must not move it."""
    before = random.getstate()
    for streak in range(1, 6):
        RestartPolicy(backoff_s=1.0, jitter_s=1.0).delay(streak)
    assert random.getstate() == before
    a, b = (
        ExponentialJitter(initial_s=1, max_s=4, jitter_s=0.5, rng=random.Random(7)) for _ in "ab"
    )
    assert [a.delay(n) for n in range(1, 6)] == [b.delay(n) for n in range(1, 6)]
    slept: list[float] = []
    calls = iter([OSError("1"), OSError("2"), OSError("3"), "done"])

    def flaky() -> str:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    wait = ExponentialJitter(initial_s=1, max_s=3, jitter_s=0.5)
    assert tenacity.Retrying(wait=wait, sleep=slept.append)(flaky) == "done"
    assert [lo <= d <= lo + 0.5 for d, lo in zip(slept, [1, 2, 3], strict=True)] == [True] * 3, (
        slept
    )
    assert slept[2] <= 3  # the ceiling includes the jitter
    with pytest.raises(ConfigError):
        ExponentialJitter(initial_s=2, max_s=1)


@pytest.mark.parametrize(
    "kw",
    [
        {"backoff_s": -1},
        {"jitter_s": -0.1},
        {"backoff_s": 10, "backoff_max_s": 5},
        {"crash_loop_restarts": 0},
    ],
)
def test_policy_rejects_bad_values(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        RestartPolicy(**kw)  # type: ignore[arg-type]


def test_tracker_resets_on_progress_and_detects_a_crash_loop() -> None:
    progress: list[int | None] = [None]
    tracker = RestartTracker(
        RestartPolicy(backoff_s=1, jitter_s=0, crash_loop_restarts=2), lambda: progress[0]
    )
    progress[0] = 10  # the first attempt committed step 10, then failed
    d = tracker.on_failure(restarts_left=5)
    assert (d.restart, d.delay_s, d.streak, d.progress, d.previous) == (True, 0.0, 0, 10, None)
    d = tracker.on_failure(restarts_left=4)  # no new checkpoint
    assert (d.restart, d.delay_s, d.streak) == (True, 1.0, 1)
    d = tracker.on_failure(restarts_left=3)
    assert (d.restart, d.delay_s, d.streak) == (True, 2.0, 2)
    assert not tracker.crash_loop
    d = tracker.on_failure(restarts_left=2)  # a third restart without progress: give up
    assert not d.restart and tracker.crash_loop and d.streak == 3
    progress[0] = 20
    assert tracker.on_failure(restarts_left=1).restart and not tracker.crash_loop


def test_tracker_stops_when_no_restart_is_left() -> None:
    tracker = RestartTracker(RestartPolicy(), lambda: 5)
    d = tracker.on_failure(restarts_left=0)
    assert not d.restart and not tracker.crash_loop


# ---------------------------------------------------------------------- command line


def _script(tmp_path: Path) -> str:
    s = tmp_path / "train.py"
    s.write_text("print('hi')\n")
    return str(s)


def test_accepts_torchrun_flags_and_chooses_c10d(tmp_path: Path) -> None:
    script = _script(tmp_path)
    cfg, args = parse_command_line(
        ["--nproc-per-node", "2", "--monitor-interval", "0.5", script, "--lr", "3"]
    )
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "localhost:0"
    assert args.max_restarts == DEFAULT_MAX_RESTARTS
    assert args.shutdown_timeout == 30  # follows the default grace period
    assert "SIGUSR1" in args.signals_to_handle.split(",")
    assert args.training_script_args == ["--lr", "3"]
    assert cfg.grace_s == 30.0 and cfg.run_dir.endswith(os.path.join("runs", args.rdzv_id))

    cfg, args = parse_command_line(
        [
            "--nnodes=1:2",
            "--rdzv-endpoint=10.0.0.1:29400",
            "--rdzv-id=job",
            "--max-restarts=2",
            "--grace-period=90",
            "--shutdown-timeout=10",
            "--run-dir",
            str(tmp_path / "run"),
            "--restart-backoff=0",
            "--crash-loop-restarts=5",
            script,
        ],
        warn=lambda msg: None,
    )
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "c10d",
        "10.0.0.1:29400",
        "job",
    )
    assert args.max_restarts == 2 and args.shutdown_timeout == 90  # raised to the grace
    assert cfg.restart.crash_loop_restarts == 5 and cfg.run_dir == str(tmp_path / "run")

    _, args = parse_command_line(["--rdzv-backend=static", "--master-port=1234", script])
    assert args.rdzv_backend == "static"  # explicit choices are kept


def test_shutdown_timeout_below_grace_is_raised_with_a_warning(tmp_path: Path) -> None:
    said: list[str] = []
    _, args = parse_command_line(
        ["--shutdown-timeout", "5", "--grace-period", "12.5", _script(tmp_path)], warn=said.append
    )
    assert args.shutdown_timeout == 13 and "shorter than --grace-period" in said[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing_script.py"], "does not exist"),
        (["--nnodes=1:4", "{script}"], "--rdzv-endpoint"),
        (["--nnodes=3:2", "{script}"], "MIN <= MAX"),
        (["--nnodes=a:b", "{script}"], "--nnodes"),
        (["--grace-period=0", "{script}"], "--grace-period"),
        (["--preempt-signals=SIGKILL", "{script}"], "can be handled"),
        (["--restart-backoff=-1", "{script}"], "backoff"),
        (["-m", "no_such_module_xyz"], "cannot be found"),
        (["--rdzv-external", "{script}"], "--rdzv-external needs --rdzv-endpoint"),
        (
            ["--rdzv-external", "--rdzv-backend=static", "--rdzv-endpoint=h:1", "{script}"],
            "c10d or etcd-v2",
        ),
        (
            ["--nnodes=1:2", "--rdzv-endpoint=h:1", "--rdzv-external", "--rdzv-wait=0", "{script}"],
            "--rdzv-wait",
        ),
    ],
)
def test_bad_usage_is_refused_up_front(tmp_path: Path, argv: list[str], message: str) -> None:
    script = _script(tmp_path)
    with pytest.raises(UsageError, match=message):
        parse_command_line([a.replace("{script}", script) for a in argv])


def test_unknown_flag_exits_with_usage_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        parse_command_line(["--no-such-flag", _script(tmp_path)])
    assert e.value.code == ExitCode.USAGE == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.timeout(120)  # run alone, it also waits for forked_cli's imports
def test_cli_refuses_a_missing_script_before_starting_anything(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    run_dir = tmp_path / "run"
    (out,) = forked_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "nope.py"])
    assert out.returncode == ExitCode.USAGE
    assert "training script 'nope.py' does not exist" in out.stderr
    assert not run_dir.exists()  # no half-started group, no run directory


# ---------------------------------------------------------------------- agent and report parts


def test_peek_exit_reads_a_status_without_reaping() -> None:
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while peek_exit(done.pid) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert peek_exit(done.pid) == 7
        assert done.wait(timeout=5) == 7  # Popen still reaps it with the right code
        assert peek_exit(sleeper.pid) is None
        sleeper.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while peek_exit(sleeper.pid) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert peek_exit(sleeper.pid) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_event_logs_read_incrementally_and_skip_torn_lines(tmp_path: Path) -> None:
    logs = EventLogs(tmp_path)
    assert logs.refresh() == [] and logs.newest_committed() is None
    (tmp_path / "logs").mkdir()
    f = tmp_path / "logs" / "rank0.jsonl"
    f.write_text(
        json.dumps({"event": "ckpt.save.committed", "step": 4, "seconds": 1.5})
        + "\n{torn json\n"
        + '{"event": "ckpt.load", "step": 2}\n{"event": "half'
    )
    assert [r["event"] for r in logs.refresh()] == ["ckpt.save.committed", "ckpt.load"]
    with f.open("a") as out:  # the half-written line is completed later
        out.write('", "step": 9}\n' + json.dumps({"event": "ckpt.save.committed", "step": 8}))
        out.write("\n")
    assert [r["event"] for r in logs.refresh()] == ["half", "ckpt.save.committed"]
    assert logs.newest_committed() == 8 and logs.longest_save_s() == 1.5


def test_failures_are_explained_from_events_and_error_files(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank1.jsonl").write_text(
        json.dumps(
            {"event": "worker.exception", "pid": 11, "rank": 1, "step": 6, "error": "KeyError: 'x'"}
        )
        + "\n"
        + json.dumps({"event": "watchdog.exit", "pid": 11, "rank": 1, "code": 84})
        + "\n"
    )
    logs = EventLogs(tmp_path)
    got = explain_failures(
        [
            (1, 1, 11, 1, None, True),
            (0, 0, 10, 1, "Traceback ...\n  File x\nValueError: bad\n", True),
            (2, 0, 12, -9, None, False),
        ],
        logs,
    )
    assert (got[0].error, got[0].step, got[0].source) == (
        "KeyError: 'x'",
        6,
        "event worker.exception",
    )
    assert (got[1].error, got[1].source) == ("ValueError: bad", "error file")
    assert got[2].error is None and got[2].meaning == describe(-9) == "killed by signal 9"

    def attempt(i: int, step: int) -> AttemptRecord:
        a = AttemptRecord(restart=i, attempt_id=str(i), started_at=0, world_size=2, group_rank=0)
        a.failures = [
            RankFailure(
                rank=1,
                local_rank=1,
                pid=i,
                exit_code=1,
                meaning="",
                root=True,
                error="RuntimeError: boom",
                step=step,
            ),
            RankFailure(rank=0, local_rank=0, pid=i, exit_code=-9, meaning="", root=False),
        ]
        return a

    rep = repeating_failure([attempt(0, 6), attempt(1, 6), attempt(2, 7)])
    assert rep == {"rank": 1, "error": "RuntimeError: boom", "step": 6, "attempts": 2, "of": 3}


# ---------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restarts_resume_from_checkpoint_then_a_crash_loop_stops(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Rank 1 raises at step 6 in every attempt; checkpoints every 4 steps.

    Attempt 0 commits step 4 and fails: progress, so an immediate restart from step 4.
    Attempts 1 and 2 fail at step 6 again without a new checkpoint: the second of them
    exceeds --crash-loop-restarts=1 and the run stops with CRASH_LOOP and a report naming
    rank 1, the exception and step 6.
    """
    run_dir, rec = tmp_path / "run", tmp_path / "rec"
    code, _, err = launcher.run(
        run_cmd(
            "--nproc-per-node=2",
            f"--run-dir={run_dir}",
            f"--checkpoint-url={tmp_path / 'ckpt'}",
            "--restart-backoff=0.2",
            "--restart-jitter=0",
            "--crash-loop-restarts=1",
            str(SUPERVISED_WORKER),
            f"--record={rec}",
            "--steps=12",
            "--save-every=4",
            "--crash-step=6",
            "--crash-rank=1",
        ),
        timeout=220,
    )
    assert code == ExitCode.CRASH_LOOP, err[-3000:]
    report = json.loads((run_dir / "supervisor_report.json").read_text())
    assert report["outcome"] == "crash loop" and report["exit_code"] == ExitCode.CRASH_LOOP
    attempts = report["attempts"]
    assert [a["action"] for a in attempts] == ["restart", "restart", "stop: crash loop"]
    assert [a["progress"] for a in attempts] == [4, 4, 4]
    assert attempts[0]["delay_s"] == 0.0 and attempts[1]["delay_s"] == pytest.approx(0.2)
    roots = [f for f in attempts[-1]["failures"] if f["root"]]
    assert [(f["rank"], f["step"], f["error"]) for f in roots] == [
        (1, 6, "RuntimeError: injected failure at step 6")
    ]
    assert report["repeating"] == {
        "rank": 1,
        "error": "RuntimeError: injected failure at step 6",
        "step": 6,
        "attempts": 2,
        "of": 2,
    }
    assert "resilient run: crash loop, exit code 86" in err
    assert "rank 1 at step 6" in report["reason"]
    # every restart resumed from the committed step 4 (steps 4 and 5 replayed, never 0-3)
    recs = records(rec)
    per_attempt: dict[str, list[int]] = {}
    for r in recs:
        per_attempt.setdefault(r["attempt"], []).append(r["step"])
    assert sorted(min(s) for s in per_attempt.values()) == [0, 4, 4]
    # rank 0 may complete step 6 (the gradients were reduced before rank 1 raised); never 7
    assert sorted(last_by_step(recs))[:6] == [0, 1, 2, 3, 4, 5]
    assert max(last_by_step(recs)) <= 6
    decided = run_events(run_dir, "restart.decided")
    assert [e["streak"] for e in decided] == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_warns_up_front_when_a_measured_save_exceeds_the_grace_period(
    tmp_path: Path, launcher: Launcher
) -> None:
    """A run directory whose logs show a 50 s save, relaunched with --grace-period 30: the
    warning comes before anything starts; a script that is not a resilient worker still runs."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.jsonl").write_text(
        json.dumps({"event": "ckpt.save.committed", "step": 8, "seconds": 50.0}) + "\n"
    )
    script = tmp_path / "hello.py"
    script.write_text(
        # one write() per line: both ranks share the pipe and run unbuffered
        "import os, sys\n"
        "sys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\")\n"
    )
    code, out, err = launcher.run(
        run_cmd("--nproc-per-node=2", f"--run-dir={run_dir}", "--grace-period=30", str(script)),
        timeout=80,
    )
    assert code == 0, err[-3000:]
    assert "took 50.0 s, close to or over --grace-period 30 s" in err
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == [
        "rank 0 of 2",
        "rank 1 of 2",
    ]
    report = json.loads((run_dir / "supervisor_report.json").read_text())
    assert report["outcome"] == "succeeded" and report["notes"]
    assert [a["outcome"] for a in report["attempts"]] == ["succeeded"]
