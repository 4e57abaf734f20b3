"""The run report's arithmetic, on hand-built event logs where every figure is known."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import pytest

from resilient.events import read_events
from resilient.report import analyze, format_report, plot_timeline

T0 = 1_800_000_000.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _write(run_dir: Path, name: str, events: list[dict]) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with (run_dir / "logs" / name).open("a") as f:
        for e in events:
            f.write(
                json.dumps({**{k: v for k, v in e.items() if k != "t"}, "ts": _iso(T0 + e["t"])})
                + "\n"
            )


def _progress(restart: int, first: int, last: int, t0: float, step_s: float) -> dict:
    t1 = t0 + (last - first + 1) * step_s
    return {
        "event": "train.progress",
        "rank": 0,
        "restart": restart,
        "first": first,
        "last": last,
        "t0": T0 + t0,
        "t1": T0 + t1,
        "t1_first": T0 + t0 + step_s,
        "busy_s": (last - first + 1) * step_s,
        "t": t1,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Attempt 0: steps 0-9 at 1 s each from t=2, saves after steps 4 and 8 (0.1 s blocked),
    killed at t=12.5 (chaos). Attempt 1 starts at t=14, resumes at step 8 at t=15, runs
    steps 8-19 at 1 s each, and ends at t=27."""
    ev = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "t": 0.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "step": 0, "t": 2.0},
        _progress(0, 0, 0, 2.0, 1.0),
        _progress(0, 1, 9, 3.0, 1.0),
        {"event": "ckpt.save.staged", "rank": 0, "restart": 0, "blocked_s": 0.1, "t": 7.0},
        {
            "event": "ckpt.save.committed",
            "rank": 0,
            "restart": 0,
            "step": 4,
            "mode": "async",
            "seconds": 0.5,
            "t": 7.5,
        },
        {"event": "ckpt.save.staged", "rank": 0, "restart": 0, "blocked_s": 0.1, "t": 11.0},
        {
            "event": "ckpt.save.committed",
            "rank": 0,
            "restart": 0,
            "step": 8,
            "mode": "async",
            "seconds": 0.5,
            "t": 11.5,
        },
        {"event": "runtime.init", "rank": 0, "restart": 1, "t": 14.0},
        {"event": "runtime.resume", "rank": 0, "restart": 1, "step": 8, "t": 15.0},
        _progress(1, 8, 8, 15.0, 1.0),
        _progress(1, 9, 19, 16.0, 1.0),
        {"event": "runtime.done", "rank": 0, "restart": 1, "step": 20, "t": 27.0},
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    _write(
        tmp_path,
        "chaos.jsonl",
        [{"event": "chaos.fault", "kind": "kill", "target_rank": 1, "pid": 1, "t": 12.5}],
    )
    return tmp_path


def test_goodput_counts_only_steps_that_survive(run_dir: Path):
    rep = analyze(run_dir)
    assert rep.wall_s == pytest.approx(27.0)
    # steps 0-7 of attempt 0 (8 s) survive; 8 and 9 were replayed; attempt 1 adds 12 s
    assert rep.productive_s == pytest.approx(20.0)
    assert rep.goodput == pytest.approx(20.0 / 27.0)
    assert rep.final_step == 20 and rep.attempts == 2 and rep.saves == 2
    assert rep.step_s == pytest.approx(1.0)
    assert rep.save_cost_s == pytest.approx(0.1)


def test_fault_times_and_steps_lost(run_dir: Path):
    (f,) = analyze(run_dir).faults
    assert f.kind == "kill" and f.exact_time
    assert f.detect_s == pytest.approx(1.5)  # no detection event: the new attempt's start
    assert f.restart_s == pytest.approx(2.5)
    assert f.recover_s == pytest.approx(3.5)  # first step of attempt 1 ends at t=16
    assert f.steps_lost == 2  # steps 8 and 9 ran twice


def test_young_daly_optimum(run_dir: Path):
    rep = analyze(run_dir, mtbf_s=100.0)
    c, m, r = 0.1, 100.0, 2.5
    x = c / (2 * m)
    tau = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert rep.optimal_interval_s == pytest.approx(tau)
    assert rep.optimal_goodput == pytest.approx(1 - c / tau - (tau / 2 + r) / m)
    text = format_report(rep)
    assert "goodput" in text and "Young/Daly" in text and "kill" in text


def test_timeline_png_is_written(run_dir: Path, tmp_path: Path):
    pytest.importorskip("matplotlib")
    out = plot_timeline(run_dir, tmp_path / "timeline.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_logs_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no events"):
        analyze(tmp_path)


def test_cli_report_prints_the_table_and_draws(run_dir: Path, tmp_path: Path, capsys):
    from resilient.cli import main

    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main(["report", str(run_dir), "--png", str(png), "--mtbf", "100"]) == 0
    out = capsys.readouterr().out
    assert "goodput              0.741" in out and "Young/Daly" in out
    assert png.exists()
    assert main(["report", str(tmp_path / "nowhere")]) == 2


def _loop(restart: int, first: int, sizes: list[int], t0: float, step_s: float, gap_s: float):
    """Contiguous progress windows of `sizes` steps: each step `step_s` of body and `gap_s`
    between steps. Returns the events and the start time of each window and the next one."""
    out, starts = [], []
    for n in sizes:
        w = _progress(restart, first, first + n - 1, t0, step_s)
        w["t1"] = T0 + t0 + n * step_s + (n - 1) * gap_s
        w["t"] = w["t1"] - T0
        out.append(w)
        starts.append(t0)
        first, t0 = first + n, t0 + n * (step_s + gap_s)
    starts.append(t0)
    return out, starts


def test_async_save_cost_counts_the_slowdown_of_the_steps_beside_it(tmp_path: Path):
    """Steps of 0.1 s body + 0.01 s between. The save in window 3 blocks 0.05 s (between two
    steps) and slows its 10 steps by 0.02 s each: it costs 0.25 s, not the 0.05 s blocked."""
    ws, at = _loop(0, 0, [1, 10, 10, 10, 10, 10], 1.0, 0.1, 0.01)
    slow = ws[3]
    slow["busy_s"] += 10 * 0.02
    for w in ws[4:]:  # the blocked time and the slowdown push the later windows back
        for k in ("t0", "t1", "t1_first"):
            w[k] += 0.25
        w["t"] += 0.25
    slow["t1"] += 0.25
    slow["t"] += 0.25
    save = {"rank": 0, "restart": 0, "step": 25}
    ev = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "t": 0.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "step": 0, "t": 0.9},
        *ws,
        {**save, "event": "ckpt.save.start", "mode": "async", "t": at[3] + 0.4},
        {**save, "event": "ckpt.save.staged", "blocked_s": 0.05, "t": at[3] + 0.5},
        {**save, "event": "ckpt.save.committed", "mode": "async", "seconds": 0.6, "t": at[3] + 1},
        {"event": "runtime.done", "rank": 0, "restart": 0, "step": 51, "t": at[-1] + 0.25 + 0.5},
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    rep = analyze(tmp_path, mtbf_s=100.0)
    assert rep.save_cost_basis == "effective"
    assert rep.blocked_s == pytest.approx(0.05)
    assert rep.save_cost_s == pytest.approx(0.25)
    assert rep.save_slowdown_s == pytest.approx(0.25)
    assert rep.step_overhead_s == pytest.approx(0.01)
    assert rep.productive_s == pytest.approx(51 * 0.1)  # the slowdown is not productive
    assert rep.startup_s == pytest.approx(1.0) and rep.end_s == pytest.approx(0.51)


def test_a_save_with_no_clean_window_to_compare_falls_back_to_blocked_time(run_dir: Path):
    rep = analyze(run_dir)
    assert rep.save_cost_basis == "blocked" and rep.save_cost_s == pytest.approx(0.1)


def test_optimum_for_the_run_adds_its_one_time_start_up_and_end(run_dir: Path):
    rep = analyze(run_dir, mtbf_s=100.0)
    assert rep.startup_s == pytest.approx(2.0) and rep.end_s == pytest.approx(0.0)
    best = rep.optimal_goodput
    assert best is not None
    run_best = 20.0 / (20.0 / best + 2.0)
    assert rep.optimal_run_goodput == pytest.approx(run_best)
    assert rep.goodput_over_optimum == pytest.approx(rep.goodput / run_best)
    assert rep.steady_goodput == pytest.approx(20.0 / 25.0)


def test_steps_replayed_after_an_attempt_that_died_before_resuming_do_not_count(tmp_path: Path):
    """Attempt 0 runs steps 0-9 (checkpoint at 8), attempt 1 dies while starting, attempt 2
    resumes at 8: steps 8 and 9 of attempt 0 were replayed, even with no resume in between."""
    ev = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "t": 0.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "step": 0, "t": 1.0},
        _progress(0, 0, 9, 1.0, 1.0),
        {"event": "runtime.init", "rank": 0, "restart": 1, "t": 13.0},
        {"event": "runtime.init", "rank": 0, "restart": 2, "t": 16.0},
        {"event": "runtime.resume", "rank": 0, "restart": 2, "step": 8, "t": 17.0},
        _progress(2, 8, 11, 17.0, 1.0),
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    rep = analyze(tmp_path)
    assert rep.productive_s == pytest.approx(8.0 + 4.0)
    assert rep.replayed_s == pytest.approx(2.0)


def test_the_supervisor_seeing_the_failed_worker_is_the_detection(run_dir: Path):
    _write(run_dir, "supervisor.jsonl", [{"event": "worker.failed", "rank": None, "t": 12.6}])
    (f,) = analyze(run_dir).faults
    assert f.detect_s == pytest.approx(0.1)


def test_a_given_save_cost_stands_in_when_the_run_cannot_measure_its_own(run_dir: Path):
    rep = analyze(run_dir, mtbf_s=100.0, save_cost_s=0.3)
    assert rep.save_cost_basis == "given" and rep.save_cost_s == pytest.approx(0.3)
    assert rep.blocked_s == pytest.approx(0.1)


def _sync_save(pid: int, step: int, t: float) -> dict:
    """Rank 0's synchronous save of `step` in attempt 0, committed at `t` (a stop's save)."""
    return {
        "event": "ckpt.save.committed",
        "rank": 0,
        "restart": 0,
        "pid": pid,
        "step": step,
        "mode": "sync",
        "seconds": 0.2,
        "t": t,
    }


def test_a_relaunch_after_a_preemption_is_a_new_attempt(tmp_path: Path) -> None:
    """A preemption ends the launch and the same command is launched again: its restart count
    starts at 0 again, yet it is the run's second attempt, and the fault between them (a
    SIGTERM, detected when the ranks agreed to stop) loses no step."""
    ev = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "pid": 100, "t": 0.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "pid": 100, "step": 0, "t": 1.0},
        _progress(0, 0, 5, 1.0, 1.0),
        {"event": "preempt.stop", "rank": 0, "restart": 0, "pid": 100, "step": 6, "t": 7.2},
        _sync_save(100, 6, 7.4),
        {"event": "runtime.init", "rank": 0, "restart": 0, "pid": 200, "t": 12.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "pid": 200, "step": 6, "t": 13.0},
        {**_progress(0, 6, 9, 13.0, 1.0), "pid": 200},
    ]
    for e in ev[2:3]:
        e["pid"] = 100
    _write(tmp_path, "rank0.jsonl", ev)
    _write(tmp_path, "chaos.jsonl", [{"event": "chaos.fault", "kind": "sigterm", "t": 7.0}])
    rep = analyze(tmp_path)
    assert rep.attempts == 2 and rep.final_step == 10
    (fault,) = rep.faults
    assert fault.kind == "sigterm" and fault.steps_lost == 0
    assert fault.detect_s == pytest.approx(0.2) and fault.restart_s == pytest.approx(6.0)
    assert rep.productive_s == pytest.approx(10.0)  # steps 0-9, each once


def _process(restart: int, pid: int, t: float, first: int, last: int) -> list[dict]:
    """Rank 0's process `pid` in attempt `restart`: started at `t`, resumed at step `first`
    one second later, then steps first..last at 1 s each."""
    return [
        {"event": "runtime.init", "rank": 0, "restart": restart, "pid": pid, "t": t},
        {
            "event": "runtime.resume",
            "rank": 0,
            "restart": restart,
            "pid": pid,
            "step": first,
            "t": t + 1.0,
        },
        {**_progress(restart, first, last, t + 1.0, 1.0), "pid": pid},
    ]


def _write_supervisor(run_dir: Path, *events: dict) -> None:
    """One supervisor process's log: its start at t=-1, then `events`."""
    sup = {"source": "supervisor", "pid": 50}
    _write(
        run_dir,
        "supervisor_a.jsonl",
        [{**sup, "event": "supervisor.start", "t": -1.0}, *({**sup, **e} for e in events)],
    )


def test_a_node_joining_is_a_membership_change_not_a_fault(tmp_path: Path) -> None:
    """A second node joins a healthy run: torch elastic stops the group (it saves on its way
    out, as at a preemption) and starts it again in the larger world, with the restart count
    still 0. That restart is no fault: it is listed apart, timed from the agent's decision,
    and does not take the slow step injected earlier as its cause or count in the MTBF."""
    ev = [
        *_process(0, 100, 0.0, 0, 7),
        {"event": "preempt.stop", "rank": 0, "restart": 0, "pid": 100, "step": 8, "t": 9.2},
        _sync_save(100, 8, 9.4),
        *_process(0, 200, 12.0, 8, 11),
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    _write_supervisor(
        tmp_path,
        {"event": "attempt.start", "restart": 0, "world_size": 2, "t": -0.5},
        {"event": "restart.membership", "grace_s": 30.0, "t": 9.0},
        {"event": "attempt.start", "restart": 0, "world_size": 4, "t": 11.5},
    )
    _write(tmp_path, "chaos.jsonl", [{"event": "chaos.fault", "kind": "slow", "t": 4.0}])
    rep = analyze(tmp_path)
    assert rep.attempts == 2 and rep.final_step == 12
    assert rep.faults == [] and rep.mtbf_s is None
    (joined,) = rep.membership
    assert joined.kind == "node joined" and joined.steps_lost == 0
    assert joined.fault_t == pytest.approx(T0 + 9.0)
    assert joined.recover_s == pytest.approx(5.0)  # the decision at 9 s, the next step at 14 s
    assert "membership change    a node joined (not a fault)" in format_report(rep)


def test_a_node_joining_after_a_failure_restart_is_an_attempt_of_its_own(tmp_path: Path) -> None:
    """One launch: a kill restarts the group (torch's count 0 -> 1), then a node joins, which
    restarts it again with the count still 1. Three attempts, one fault, one membership
    change; each step counts once."""
    ev = [
        *_process(0, 100, 0.0, 0, 5),
        _sync_save(100, 4, 5.5),
        *_process(1, 200, 10.0, 4, 9),
        {**_sync_save(200, 10, 17.4), "restart": 1},
        *_process(1, 300, 20.0, 10, 13),
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    _write_supervisor(
        tmp_path,
        {"event": "worker.failed", "restart": 0, "rank": None, "t": 7.0},
        {"event": "restart.membership", "grace_s": 30.0, "t": 17.0},
    )
    _write(tmp_path, "chaos.jsonl", [{"event": "chaos.fault", "kind": "kill", "t": 6.5}])
    rep = analyze(tmp_path)
    assert rep.attempts == 3 and rep.final_step == 14
    (fault,) = rep.faults
    assert fault.kind == "kill" and fault.attempt == 0 and fault.steps_lost == 2
    (joined,) = rep.membership
    assert joined.attempt == 1 and joined.steps_lost == 0
    assert joined.recover_s == pytest.approx(5.0)  # the decision at 17 s, the next step at 22 s
    assert rep.productive_s == pytest.approx(14.0)  # steps 0-13, each once


def _hot_run(tmp_path: Path) -> Path:
    """Attempt 0: steps 0-5, a raise at t=7.2 rolled back in place to step 4 (agreed 7.3, done
    7.5), steps 4-9 again from 7.6, an OOM retried in place at t=14.1 (step 10), steps 10-11;
    a kill at t=16.5 and a cold restart (attempt 1) resuming at step 8 at t=19, steps 8-13;
    then a kill replaced hot at t=26.2 (detected 26.4, formed 27.0, 1 step lost), steps
    13-15 from 27.1."""
    w0 = _progress(0, 0, 5, 1.0, 1.0)
    w1 = _progress(0, 4, 9, 7.6, 1.0)
    w2 = _progress(0, 10, 11, 13.6, 1.0)
    w3 = _progress(1, 8, 13, 19.0, 1.0)
    w4 = _progress(1, 13, 15, 27.1, 1.0)
    ev = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "t": 0.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "step": 0, "t": 1.0},
        w0,
        {"event": "rollback.agreed", "rank": 0, "restart": 0, "step": 6, "to_step": 4, "t": 7.3},
        {"event": "rollback.done", "rank": 0, "restart": 0, "to_step": 4, "t": 7.5},
        w1,
        {"event": "oom.retry", "rank": 0, "restart": 0, "step": 10, "split_to": 2, "t": 14.2},
        w2,
        {"event": "runtime.init", "rank": 0, "restart": 1, "t": 18.0},
        {"event": "runtime.resume", "rank": 0, "restart": 1, "step": 8, "t": 19.0},
        w3,
        {"event": "recovery.hot.detect", "rank": 0, "restart": 1, "t": 26.4},
        {"event": "recovery.hot.formed", "rank": 0, "restart": 1, "steps_lost": 1, "t": 27.0},
        w4,
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    _write(
        tmp_path,
        "chaos.jsonl",
        [
            {"event": "chaos.fault", "kind": "raise", "target_rank": 1, "t": 7.2},
            {"event": "chaos.fault", "kind": "oom", "target_rank": 0, "t": 14.1},
            {"event": "chaos.fault", "kind": "kill", "target_rank": 1, "t": 16.5},
            {"event": "chaos.fault", "kind": "kill", "target_rank": 0, "t": 26.2},
        ],
    )
    return tmp_path


def test_hot_and_cold_recoveries_each_with_their_own_fault(tmp_path: Path):
    from resilient.report import COLD, HOT_REPLACEMENT, HOT_ROLLBACK, RETRY

    rep = analyze(_hot_run(tmp_path))
    got = [(f.kind, f.recovery, f.attempt, f.steps_lost) for f in rep.faults]
    assert got == [
        ("raise", HOT_ROLLBACK, 0, 2),  # steps 4 and 5 ran again
        ("oom", RETRY, 0, 0),
        ("kill", COLD, 0, 4),  # steps 8-11 ran again
        ("kill", HOT_REPLACEMENT, 1, 1),
    ]
    raise_, oom, kill, hot_kill = rep.faults

    def near(x: float | None, want: float) -> bool:
        return x == pytest.approx(want, abs=1e-3)  # ISO timestamps keep microseconds

    assert near(raise_.detect_s, 0.1)  # the agreement named it
    assert near(raise_.restart_s, 0.3)  # restored at rollback.done
    assert near(raise_.recover_s, 1.4)  # the first step after it ends at 8.6
    assert near(oom.detect_s, 0.1) and near(oom.recover_s, 0.5)  # step 10 ends at 14.6
    assert near(kill.detect_s, 1.5) and near(kill.restart_s, 2.5)
    assert near(hot_kill.detect_s, 0.2) and near(hot_kill.recover_s, 1.9)
    text = format_report(rep)
    assert "hot rollback" in text and "hot replacement" in text and "cold restart" in text
    assert "1 cold restart, 1 hot replacement, 1 hot rollback, 1 oom retry" in text


def test_steps_replayed_after_a_rollback_in_place_are_not_counted_twice(tmp_path: Path):
    rep = analyze(_hot_run(tmp_path))
    # survive: 0-3 (w0), 4-7 (w1; 8-9 replayed by attempt 1), 8-12 (w3; 13 replayed hot),
    # 13-15 (w4): 16 steps of 1 s; replayed: 4-5, 8-11 and 13, 7 s
    assert rep.productive_s == pytest.approx(16.0)
    assert rep.replayed_s == pytest.approx(7.0)
    assert rep.final_step == 16


def test_a_hot_replacement_of_rank_0_is_not_a_new_attempt(tmp_path: Path):
    """Rank 0 killed and replaced hot: the replacement's runtime.init has a new pid with
    restart 0 (generation 1), which must not read as a relaunch. A later cold restart's
    restore time runs to its own resume, not to a hot resume later in that attempt."""
    from resilient.report import COLD, HOT_REPLACEMENT

    def init(pid: int, restart: int, gen: int, t: float) -> dict:
        return {"event": "runtime.init", "rank": 0, "restart": restart, "pid": pid,
                "generation": gen, "t": t}  # fmt: skip

    def resume(pid: int, restart: int, step: int, t: float, **kw: object) -> dict:
        return {"event": "runtime.resume", "rank": 0, "restart": restart, "pid": pid,
                "step": step, "t": t, **kw}  # fmt: skip

    def formed(pid: int, restart: int, t: float) -> dict:
        return {"event": "recovery.hot.formed", "rank": 0, "restart": restart, "pid": pid,
                "steps_lost": 1, "t": t}  # fmt: skip

    ev = [
        init(100, 0, 0, 0.0),
        resume(100, 0, 0, 1.0),
        {**_progress(0, 0, 5, 1.0, 1.0), "pid": 100},
        init(300, 0, 1, 7.5),  # the spare in rank 0's place
        formed(300, 0, 7.8),
        resume(300, 0, 5, 7.8, hot=True),
        {**_progress(0, 5, 9, 7.9, 1.0), "pid": 300},
        init(400, 1, 0, 15.0),  # cold restart after the kill at 13.0
        resume(400, 1, 8, 16.0),
        {**_progress(1, 8, 9, 16.0, 1.0), "pid": 400},
        init(400, 1, 1, 19.2),  # rank 1 replaced: rank 0 survives and runs the script again
        formed(400, 1, 19.5),
        resume(400, 1, 9, 19.5, hot=True),
        {**_progress(1, 9, 11, 19.6, 1.0), "pid": 400},
    ]
    _write(tmp_path, "rank0.jsonl", ev)
    _write(
        tmp_path,
        "chaos.jsonl",
        [
            {"event": "chaos.fault", "kind": "kill", "target_rank": 0, "t": 7.2},
            {"event": "chaos.fault", "kind": "kill", "target_rank": 1, "t": 13.0},
            {"event": "chaos.fault", "kind": "kill", "target_rank": 1, "t": 19.0},
        ],
    )
    rep = analyze(tmp_path)
    assert rep.attempts == 2 and rep.final_step == 12
    got = [(f.kind, f.recovery, f.attempt) for f in rep.faults]
    assert got == [("kill", HOT_REPLACEMENT, 0), ("kill", COLD, 0), ("kill", HOT_REPLACEMENT, 1)]
    assert rep.faults[0].restart_s == pytest.approx(0.6, abs=1e-3)
    assert rep.faults[1].restart_s == pytest.approx(3.0, abs=1e-3)  # to the cold resume at 16
    assert rep.faults[1].steps_lost == 2  # steps 8 and 9 ran again


def test_a_fault_right_after_a_rollback_is_labelled_before_rank_0_says_it_is_done(
    tmp_path: Path,
) -> None:
    """Rank 1 raises at t=4 and both roll back; rank 1 is done at t=5.0 and raises again at
    t=5.1, before rank 0 logs its own rollback.done (t=5.2). The second raise is the cold
    restart's fault, not an unknown one (a CI run saw it labelled "unknown")."""
    r0 = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "t": 0.0},
        {"event": "runtime.resume", "rank": 0, "restart": 0, "step": 0, "t": 1.0},
        _progress(0, 0, 2, 1.0, 1.0),
        {"event": "rollback.agreed", "rank": 0, "restart": 0, "step": 3, "t": 4.1},
        {"event": "rollback.done", "rank": 0, "restart": 0, "t": 5.2},
        {"event": "rollback.refused", "rank": 0, "restart": 0, "step": 3, "t": 5.3},
        {"event": "runtime.init", "rank": 0, "restart": 1, "t": 8.0},
        {"event": "runtime.resume", "rank": 0, "restart": 1, "step": 0, "t": 9.0},
        _progress(1, 0, 5, 9.0, 1.0),
    ]
    r1 = [{"event": "rollback.done", "rank": 1, "restart": 0, "t": 5.0}]
    _write(tmp_path, "rank0.jsonl", r0)
    _write(tmp_path, "rank1.jsonl", r1)
    raises = [
        {"event": "chaos.fault", "kind": "raise", "target_rank": 1, "pid": 1, "t": t}
        for t in (4.0, 5.1)
    ]
    _write(tmp_path, "chaos.jsonl", raises)
    faults = analyze(tmp_path).faults
    assert [(f.kind, f.recovery) for f in faults] == [
        ("raise", "hot rollback"),
        ("raise", "cold restart"),
    ]
    assert [f.fault_t for f in faults] == [pytest.approx(T0 + 4.0), pytest.approx(T0 + 5.1)]


# ------------------------------------------------------------------ recorded real runs
RECORDED = Path(__file__).resolve().parent / "data" / "report_runs"
"""Event logs of real short runs, recorded by tests/record_report_runs.py (see there)."""


def _without_chaos(name: str, tmp_path: Path) -> Path:
    """A recorded run's logs without the chaos harness's record: a user's run reads so."""
    dst = tmp_path / name
    (dst / "logs").mkdir(parents=True)
    for f in (RECORDED / name / "logs").glob("*.jsonl"):
        if f.name != "chaos.jsonl":
            (dst / "logs" / f.name).write_bytes(f.read_bytes())
    return dst


def _named(name: str, tmp_path: Path) -> tuple[list, list]:
    """(the faults with chaos's record, the same without it); goodput is the same both ways."""
    with_chaos, without = analyze(RECORDED / name), analyze(_without_chaos(name, tmp_path))
    assert without.goodput == with_chaos.goodput
    assert without.productive_s == with_chaos.productive_s
    assert [f.recovery for f in without.faults] == [f.recovery for f in with_chaos.faults]
    assert all(f.kind != "unknown" for f in without.faults)
    return with_chaos.faults, without.faults


def test_a_stopped_rank_replaced_hot_is_named_with_its_wait_for_the_timeout(tmp_path: Path):
    """A SIGSTOPped rank replaced hot: named "stopped" from the watchdog's verdict, detected
    after the heartbeat timeout (3 s here), counted from the rank's last heartbeat."""
    (chaos,), (own,) = _named("stopped", tmp_path)
    assert (chaos.kind, own.kind) == ("stop", "stopped")
    (verdict,) = [
        e
        for e in read_events(RECORDED / "stopped", "hang.detected")
        if e.get("kind") == "no_heartbeat"
    ]
    silent = verdict["named"][0]["silent_s"]
    assert silent >= 3.0 and own.detect_s == pytest.approx(silent, abs=1e-3)
    assert chaos.detect_s is not None and abs(own.detect_s - chaos.detect_s) < 0.5
    assert not own.exact_time and "stopped " in format_report(analyze(tmp_path / "stopped"))


def test_numeric_and_lost_process_restarts_are_named(tmp_path: Path):
    """A NaN at step 6 restarted cold (snapshots off), then a rank SIGKILLed: "numeric" with
    its step, and "lost process"."""
    chaos, own = _named("numeric", tmp_path)
    assert [(f.kind, f.step) for f in chaos] == [("nan", 6), ("kill", None)]
    assert [(f.kind, f.step) for f in own] == [("numeric", 6), ("lost process", None)]
    assert "numeric @6" in format_report(analyze(tmp_path / "numeric"))


def test_hot_recoveries_are_named_as_the_guard_and_the_survivors_saw_them(tmp_path: Path):
    chaos, own = _named("hot", tmp_path)
    assert [f.kind for f in chaos] == ["raise", "oom", "kill"]
    assert [f.kind for f in own] == ["exception", "oom", "lost process"]


def test_a_preemption_is_named_from_the_ranks_agreement(tmp_path: Path) -> None:
    test_a_relaunch_after_a_preemption_is_a_new_attempt(tmp_path)
    (tmp_path / "logs" / "chaos.jsonl").unlink()
    (fault,) = analyze(tmp_path).faults
    assert fault.kind == "preemption" and fault.steps_lost == 0
