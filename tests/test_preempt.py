"""Preemption: a signal to the launcher or to one worker stops every rank at one agreed step,
commits a checkpoint inside the grace period and exits ExitCode.PREEMPTED."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers import (
    SUPERVISED_WORKER,
    Launcher,
    records,
    run_cmd,
    run_events,
    start,
    wait_for,
    worker_pids,
)

from resilient.checkpoint import CheckpointConfig, CheckpointManager
from resilient.envvars import ENV_GRACE_S, ENV_PREEMPT, ENV_PREEMPT_SIGNALS, parse_signals
from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.preempt.watch import PreemptConfig, Preempted, PreemptionWatch

# ---------------------------------------------------------------------- units


def test_parse_signals() -> None:
    assert parse_signals("SIGTERM, usr1,SIGUSR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == () and parse_signals("") == ()
    for bad in ("SIGKILL", "SIGSTOP", "SIGNOPE"):
        with pytest.raises(ConfigError):
            parse_signals(bad)


def test_config_from_environment_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_GRACE_S, "120")
    monkeypatch.setenv(ENV_PREEMPT_SIGNALS, "SIGUSR1")
    cfg = PreemptConfig.from_env()
    assert cfg.grace_s == 120.0 and cfg.signals == ("SIGUSR1",) and cfg.exit_margin_s == 2.0
    assert PreemptConfig.from_env({"grace_s": 5, "signals": "TERM"}).signals == ("SIGTERM",)
    assert PreemptConfig(grace_s=5).exit_margin_s == pytest.approx(0.5)
    monkeypatch.setenv(ENV_GRACE_S, "soon")
    with pytest.raises(ConfigError, match="RESILIENT_GRACE_S"):
        PreemptConfig.from_env()
    monkeypatch.delenv(ENV_GRACE_S)
    monkeypatch.setenv(ENV_PREEMPT, '{"check_interval_s": 0.1, "grace_s": 9}')
    cfg = PreemptConfig.from_env({"grace_s": 5})  # explicit options win over the variable
    assert cfg.check_interval_s == 0.1 and cfg.grace_s == 5
    for bad in ("[1]", "{oops"):
        monkeypatch.setenv(ENV_PREEMPT, bad)
        with pytest.raises(ConfigError, match="RESILIENT_PREEMPT"):
            PreemptConfig.from_env()
    monkeypatch.delenv(ENV_PREEMPT)
    with pytest.raises(ConfigError, match="unknown preempt option"):
        PreemptConfig.from_env({"grace": 3})
    for kw in ({"grace_s": 0}, {"check_every_steps": 0}, {"grace_s": 5, "exit_margin_s": 5}):
        with pytest.raises(ConfigError):
            PreemptConfig(**kw)  # type: ignore[arg-type]


def test_watch_flags_a_signal_and_budgets_the_save() -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch(
        PreemptConfig(signals=("SIGUSR1",), grace_s=10, exit_margin_s=1, check_every_steps=2),
        group=None,
        distributed=False,
    )
    watch.install()
    try:
        assert not watch.agree(force=True) and watch.remaining_s() == float("inf")
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not watch.requested and time.monotonic() < deadline:
            time.sleep(0.001)  # the handler runs between bytecodes of the main thread
        assert watch.requested and watch.signal_name == "SIGUSR1"
        assert not watch.agree()  # every second call only
        assert watch.agree() and watch.checks == 2
        at = watch.signal_at
        assert at is not None
        assert watch.remaining_s(now=at + 4) == pytest.approx(5.0)  # 10 - 4 - margin 1
        fits, est, left = watch.budget(3.0)
        assert fits and est == 3.0 and 0 < left <= 9.0
        assert watch.budget(None)[0]  # unknown: try (a torn save is never loaded)
        assert not watch.budget(60.0)[0]
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous
    exc = Preempted(step=7, committed=7)
    assert isinstance(exc, SystemExit) and exc.code == ExitCode.PREEMPTED == 85


def test_auto_check_interval_spreads_the_agreement_over_steps() -> None:
    """By default the flag is agreed about every min(1 s, 5% of grace): N steps, derived from
    the slowest rank's step time that the agreement itself carries (so N is the same on every
    rank). A signal is still seen within N steps."""
    cfg = PreemptConfig(signals=("SIGUSR1",), grace_s=10)
    assert cfg.check_every_steps is None and cfg.check_interval_s == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="check_interval_s"):
        PreemptConfig(grace_s=10, check_interval_s=20)
    watch = PreemptionWatch(cfg, group=None, distributed=False)
    watch.install()
    try:
        assert watch.every == 1
        while watch.checks < 3:  # the first agreement only starts the clock
            time.sleep(0.05)  # a 50 ms step
            assert not watch.agree()
        assert 5 <= watch.every <= 10, watch.every  # 0.5 s / 50 ms, less under load
        every, before = watch.every, watch.checks
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not watch.requested and time.monotonic() < deadline:
            time.sleep(0.001)  # the handler runs between bytecodes of the main thread
        assert watch.requested
        seen = [watch.agree() for _ in range(every)]
        assert seen == [False] * (every - 1) + [True] and watch.checks == before + 1
    finally:
        watch.uninstall()


# ---------------------------------------------------------------------- end to end


def _committed(url: Path) -> list[int]:
    return [i.step for i in CheckpointManager(CheckpointConfig(url=str(url))).list() if i.committed]


def _launch_args(tmp_path: Path, grace_s: float, *worker_args: str) -> list[str]:
    """`resilient run` on 2 ranks of the supervised worker, with run/, rec/ and ckpt/ under
    tmp_path."""
    return [
        "--nproc-per-node=2",
        f"--run-dir={tmp_path / 'run'}",
        f"--checkpoint-url={tmp_path / 'ckpt'}",
        f"--grace-period={grace_s:g}",
        str(SUPERVISED_WORKER),
        f"--record={tmp_path / 'rec'}",
        *worker_args,
    ]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigterm_to_launcher_commits_the_stop_step_then_resumes(
    tmp_path: Path, launcher: Launcher
) -> None:
    """No policy save happens (--save-every 100): the only checkpoint is the preemption's.
    Zero steps lost: it holds every step completed before the stop; the next launch resumes
    there and the run finishes with each step done once. The ranks' DataLoader workers are in
    the process groups the agent signals, and must not take their rank down with them."""
    run_dir, rec, ckpt = tmp_path / "run", tmp_path / "rec", tmp_path / "ckpt"
    args = _launch_args(
        tmp_path,
        20,
        *("--steps=10", "--save-every=100", "--sleep=0.3"),
        "--workers=2",  # loader workers get the launcher's SIGTERM too (they must ignore it)
    )
    run = start(run_cmd(*args), tmp_path / "first.log")
    try:
        wait_for(lambda: len(records(rec)) >= 6, timeout=120, what="three steps on both ranks")
        t_signal = time.time()
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(60)
    finally:
        run.kill(also=tuple(worker_pids(run_dir).values()))
    log = (tmp_path / "first.log").read_text()
    assert code == ExitCode.PREEMPTED, log[-3000:]
    stops = run_events(run_dir, "preempt.stop")
    assert len(stops) == 2 and len({e["step"] for e in stops}) == 1  # one agreed step
    stop = stops[0]["step"]
    assert _committed(ckpt) == [stop]
    recs = records(rec)
    assert {r["rank"]: max(x["step"] for x in recs if x["rank"] == r["rank"]) for r in recs} == {
        0: stop - 1,
        1: stop - 1,
    }  # zero steps lost: the checkpoint holds every step that ran
    exits = run_events(run_dir, "preempt.exit")
    assert {e["committed"] for e in exits} == {stop} and {e["code"] for e in exits} == {85}
    committed_at = min(e["ts"] for e in run_events(run_dir, "preempt.committed"))
    assert committed_at  # the commit was logged (timings are not asserted: shared CPUs)
    assert "stopped at step" in log and "preempted, exit code 85" in log
    assert time.time() - t_signal < 60

    code, _, err = launcher.run(run_cmd(*args), timeout=150)
    assert code == 0, err[-3000:]
    recs = records(rec)
    steps = sorted(r["step"] for r in recs if r["rank"] == 0)
    assert steps == list(range(10))  # each step exactly once across the two launches
    assert run_events(run_dir, "ckpt.load")[-1]["step"] == stop


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_signal_to_one_worker_with_no_time_left_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """SIGUSR1 to rank 1 only, as its step starts a 1 s sleep, with a 0.5 s grace: by the
    time the ranks agree at the step boundary the budget is gone, so no save is started; every
    rank leaves with PREEMPTED and the last policy checkpoint stays the newest valid one."""
    run_dir, rec, ckpt = tmp_path / "run", tmp_path / "rec", tmp_path / "ckpt"
    args = _launch_args(tmp_path, 0.5, "--steps=40", "--save-every=2", "--sync", "--sleep=1.0")
    run = start(run_cmd(*args), tmp_path / "run.log")
    try:
        wait_for(lambda: len(records(rec)) >= 4, timeout=120, what="two steps on both ranks")
        # signal right after an even step s is recorded: its boundary (s + 1 steps done) is
        # not a policy save, so the stop has something new to save and no time to do it
        done = max(r["step"] for r in records(rec) if r["rank"] == 1)
        target = done + 1 if done % 2 else done + 2
        wait_for(
            lambda: any(r["step"] == target for r in records(rec) if r["rank"] == 1),
            timeout=30,
            what=f"step {target} on rank 1",
        )
        os.kill(worker_pids(run_dir)[1], signal.SIGUSR1)
        code = run.wait(60)
    finally:
        run.kill(also=tuple(worker_pids(run_dir).values()))
    assert code == ExitCode.PREEMPTED, (tmp_path / "run.log").read_text()[-3000:]
    skipped = run_events(run_dir, "preempt.skip_save")
    assert len(skipped) == 2 and len({e["step"] for e in skipped}) == 1
    stop = skipped[0]["step"]
    assert all(e["remaining_s"] < e["estimate_s"] for e in skipped)
    newest = _committed(ckpt)[-1]
    assert newest < stop and {e["newest_valid"] for e in skipped} == {newest}
    assert not (ckpt / f"step_{stop:09d}").exists()  # nothing started, nothing torn
    stops = run_events(run_dir, "preempt.stop")
    assert sorted(e["signalled_here"] for e in stops) == [False, True]
    assert (
        CheckpointManager(CheckpointConfig(url=str(ckpt))).verify(
            newest, CheckpointManager(CheckpointConfig(url=str(ckpt))).read_manifest(newest)
        )
        == []
    )


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_signal_after_the_last_agreement_still_stops_as_a_preemption(
    tmp_path: Path, launcher: Launcher
) -> None:
    """Agreements are spread over steps; here none falls inside the run (every 1000 steps).
    SIGTERM to rank 1 during the last step: the run must not slip into its ordinary final
    save (which knows nothing of the grace period) and exit 0. One forced agreement at the
    end makes it a preemption: the final step is committed and every rank exits 85. The next
    launch resumes at the end and has nothing left to do."""
    run_dir, rec, ckpt = tmp_path / "run", tmp_path / "rec", tmp_path / "ckpt"
    args = _launch_args(
        tmp_path,
        20,
        *("--steps=6", "--save-every=100", "--sleep=0.5"),
        '--preempt={"check_every_steps": 1000}',
    )
    run = start(run_cmd(*args), tmp_path / "first.log")
    try:
        wait_for(
            lambda: any(r["step"] == 5 for r in records(rec) if r["rank"] == 1),
            timeout=120,
            what="the last step on rank 1",
        )
        os.kill(worker_pids(run_dir)[1], signal.SIGTERM)  # while its last step sleeps
        code = run.wait(60)
    finally:
        run.kill(also=tuple(worker_pids(run_dir).values()))
    assert code == ExitCode.PREEMPTED, (tmp_path / "first.log").read_text()[-3000:]
    exits = run_events(run_dir, "preempt.exit")
    assert len(exits) == 2 and {e["committed"] for e in exits} == {6}
    assert sorted(e["signalled_here"] for e in run_events(run_dir, "preempt.stop")) == [False, True]
    assert _committed(ckpt) == [6]

    code, _, err = launcher.run(run_cmd(*args), timeout=150)
    assert code == 0, err[-3000:]
    steps = sorted(r["step"] for r in records(rec) if r["rank"] == 0)
    assert steps == list(range(6))  # nothing ran twice
