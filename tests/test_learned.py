"""Learned timeouts as a unit (hang/learned.py): the statistics, the table, its agreement and
checkpoint round trip, and the detector judging by it, with simulated heartbeats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from resilient import storekeys
from resilient.errors import ConfigError
from resilient.hang.config import WatchdogConfig
from resilient.hang.heartbeat import HangDetector
from resilient.hang.learned import MIN_SAMPLES, LearnedTimeouts, PhaseStats, agree
from resilient.hang.phases import FLAG_HELD, FLAG_WARM, Phase, Progress
from resilient.report import analyze, format_report
from resilient.report.causes import cause_of
from tests.test_heartbeat_sim import IV, Sim, cfg, run_until_detection

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("kw", "fix"),
    [
        ({"learn_factor": 1.5}, "learn_factor .* at least 2"),
        ({"learn_floor_s": 0.2}, "raise learn_floor_s"),
        ({"heartbeat_learn_floor_s": 0.6}, "raise heartbeat_learn_floor_s"),
        ({"learn_quantile": 0.2}, "learn_quantile"),
        ({"learn_warmup_steps": 0}, "learn_warmup_steps"),
    ],
)
def test_bad_learning_settings_are_config_errors(kw: dict[str, float], fix: str) -> None:
    with pytest.raises(ConfigError, match=fix):
        cfg(**kw)


def _stats(durations: dict[Phase, list[float]]) -> PhaseStats:
    s = PhaseStats()
    for phase, ds in durations.items():
        for d in ds:
            s.add(phase, d)
    return s


def test_table_is_factor_times_quantile_above_the_floor_below_the_ceiling() -> None:
    c = cfg(
        timeout_s=60.0,
        startup_timeout_s=120.0,
        checkpoint_timeout_s=90.0,
        learn_floor_s=1.0,
        learn_factor=10.0,
        learn_warmup_steps=5,
    )
    lt = LearnedTimeouts(c, world_size=2)
    stats = _stats(
        {
            Phase.FORWARD: [0.3] * 50,  # 10 x 0.3 = 3 s
            Phase.DATA: [0.01] * 50,  # 0.1 s: the floor, 1 s
            Phase.BACKWARD: [8.0] * 50,  # 80 s: the ceiling, 60 s
            Phase.OPTIMIZER: [0.1] * (MIN_SAMPLES - 1),  # too few: unknown
            Phase.CHECKPOINT: [0.1] * 50,  # never learned
        }
    )
    assert np.isnan(lt.local(stats, steps_done=4)).all()  # warm-up
    t = lt.local(stats, steps_done=5)
    assert t[Phase.FORWARD] == pytest.approx(3.0)
    assert t[Phase.DATA] == 1.0 and t[Phase.BACKWARD] == 60.0
    assert math.isnan(t[Phase.OPTIMIZER]) and math.isnan(t[Phase.CHECKPOINT])
    pinned = LearnedTimeouts(cfg(phase_timeouts_s={"forward": 40}), world_size=2)
    assert math.isnan(pinned.local(stats, steps_done=100)[Phase.FORWARD])  # pinned: fixed
    off = LearnedTimeouts(cfg(learn_timeouts=False), world_size=2)
    assert np.isnan(off.local(stats, steps_done=100)).all()


def test_agreement_is_the_largest_and_unknown_while_any_rank_is() -> None:
    a = np.array([1.0, 2.0, math.nan])
    b = np.array([3.0, 1.0, 5.0])
    got = agree([a, b])
    assert got[0] == 3.0 and got[1] == 2.0 and math.isnan(got[2])


def test_state_travels_in_a_checkpoint_and_is_dropped_on_another_world_size() -> None:
    c = cfg(learn_floor_s=1.0)
    lt = LearnedTimeouts(c, world_size=4)
    table = np.full(len(Phase), math.nan)
    table[Phase.FORWARD] = 2.5
    assert lt.adopt(table)
    assert not lt.adopt(table)  # unchanged: no new event
    sd = lt.state_dict()
    assert sd == {"timeouts": {"forward": 2.5}, "world_size": 4}
    same = LearnedTimeouts(c, world_size=4)
    same.load_state_dict(sd)
    assert same.restored[Phase.FORWARD] == 2.5 and same.agreed[Phase.FORWARD] == 2.5
    # before its own warm-up a resumed rank publishes the restored table
    assert same.local(PhaseStats(), steps_done=0)[Phase.FORWARD] == 2.5
    resized = LearnedTimeouts(c, world_size=2)
    resized.load_state_dict(sd)
    assert np.isnan(resized.restored).all()
    pinned = LearnedTimeouts(cfg(phase_timeouts_s={"forward": 9}), world_size=4)
    pinned.load_state_dict(sd)
    assert np.isnan(pinned.restored).all()  # a pin made since wins


def test_progress_records_warm_intervals_only() -> None:
    p = Progress()
    p.stats = PhaseStats()
    p.begin_step(0)
    p.enter(Phase.FORWARD)
    p.enter(Phase.BACKWARD)
    p.end_step()  # the first step of an attempt: not recorded
    assert p.stats.count(Phase.FORWARD) == 0
    p.begin_step(1)
    p.enter(Phase.DATA)
    p.one_off()  # an epoch's first batch: not recorded either
    p.enter(Phase.FORWARD)
    p.enter(Phase.BACKWARD)
    assert p.stats.count(Phase.DATA) == 0 and p.stats.count(Phase.FORWARD) == 1


def _learned_detector(n: int, forward_s: float = 5.0) -> HangDetector:
    det = HangDetector(cfg(timeout_s=60.0, startup_timeout_s=180.0), range(n))
    table = np.full(len(Phase), math.nan)
    table[[Phase.FORWARD, Phase.BACKWARD, Phase.STEP]] = forward_s
    det.set_learned(table)
    return det


def _ddp_stall(sim: Sim, stall_at: float, *, sleeper: int, peer_phase: Phase = Phase.BACKWARD):
    def step(now: float) -> None:
        for r in range(sim.n):
            if now < stall_at:
                sim.set(r, now, phase=Phase.FORWARD, step=int(now), seq=int(now / IV))
            elif r != sleeper and sim.progress[r].phase != peer_phase:
                sim.set(r, now, phase=peer_phase, step=sim.progress[r].step, seq=1000)

    return step


def test_a_stall_is_named_after_the_learned_timeout_not_the_fixed_one() -> None:
    clock = [0.0]
    sim = Sim(3)
    det = _learned_detector(3)
    det._clock = lambda: clock[0]
    t, found = run_until_detection(det, sim, clock, 100, _ddp_stall(sim, 10.0, sleeper=1))
    assert found is not None and found.ranks == (1,)
    d = found.details[0]
    assert (d.timeout_kind, d.timeout_s) == ("learned", 5.0)
    assert t - 9.5 <= 5.0 + IV + 1e-9


def test_a_peer_in_a_long_phase_keeps_everyone_on_the_fixed_timeouts() -> None:
    """Rank 0 evaluates for 30 s (its own phase, fixed 30 s) while rank 1 waits in a
    collective: no verdict, though rank 1 waits 6x its learned timeout."""
    clock = [0.0]
    sim = Sim(2)
    det = _learned_detector(2)
    det._clock = lambda: clock[0]
    step = _ddp_stall(sim, 10.0, sleeper=0)

    def with_eval(now: float) -> None:
        step(now)
        if now >= 10.0 and sim.progress[0].phase != Phase.EVAL:
            sim.set(0, now, phase=Phase.EVAL, step=9, seq=2000)

    _, found = run_until_detection(det, sim, clock, 39.0, with_eval)
    assert found is None

    def after_eval(now: float) -> None:  # rank 0 is back: rank 1's wait counts from now on
        if sim.progress[0].phase == Phase.EVAL:
            sim.set(0, now, phase=Phase.BACKWARD, step=10, seq=3000)

    t, found = run_until_detection(det, sim, clock, 60.0, after_eval)
    assert found is not None and found.ranks == (1,) and found.details[0].timeout_kind == "learned"
    assert t >= 39.5 + 5.0, t


def test_the_first_step_and_a_one_off_keep_the_fixed_timeout() -> None:
    clock = [0.0]
    sim = Sim(2)
    for p in sim.progress:
        p.flags &= ~FLAG_WARM  # the first step of an attempt
    det = _learned_detector(2)
    det._clock = lambda: clock[0]
    _, found = run_until_detection(det, sim, clock, 250, _ddp_stall(sim, 10.0, sleeper=1))
    assert found is not None and found.details[0].timeout_kind == "first_step"
    assert found.details[0].timeout_s == 120.0  # timeout_s + 60 s

    clock[0] = 0.0
    sim = Sim(2)
    det = _learned_detector(2)
    det._clock = lambda: clock[0]
    base = _ddp_stall(sim, 10.0, sleeper=1)

    def one_off(now: float) -> None:
        base(now)
        if now >= 10.0:
            sim.progress[1].one_off()

    _, found = run_until_detection(det, sim, clock, 100, one_off)
    assert found is not None and found.details[0].timeout_kind == "fixed"
    assert found.details[0].timeout_s == 60.0


def test_the_report_says_which_timeout_fired() -> None:
    """`resilient report`'s cause of a hang: its kind, dated at the sleeper's last progress,
    and the timeout that fired with its value."""
    named = {"rank": 1, "step": 40, "progress_age_s": 1.3}
    hang = {"event": "hang.detected", "t": 100.0, "kind": "stalled", "exit_code": 81}
    learned = cause_of([{**hang, "named": [{**named, "timeout_kind": "learned", "timeout_s": 1}]}])
    assert learned is not None and learned.kind == "hang"
    assert learned.timeout == "learned 1.00 s" and learned.fault_t == pytest.approx(98.7)
    fixed = cause_of([{**hang, "named": [{**named, "timeout_kind": "fixed", "timeout_s": 300}]}])
    assert fixed is not None and fixed.timeout == "fixed 300.00 s"
    by_agent = {**hang, "kind": "no_heartbeat", "by": "agent"}
    state = {"rank": 1, "state": "stopped", "silent_s": 1.0, "timeout_kind": "process_state"}
    stopped = cause_of([{**by_agent, "named": [state]}])
    assert stopped is not None and (stopped.kind, stopped.timeout) == ("stopped", "process state")
    zombie = cause_of([{**by_agent, "named": [{**state, "state": "zombie"}]}])
    assert zombie is not None and zombie.kind == "lost process"


def test_the_report_lists_the_learned_and_the_pinned_timeouts(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [
        {"event": "runtime.init", "rank": 0, "restart": 0, "ts": "2026-12-01T10:00:00Z"},
        {
            "event": "hang.timeouts",
            "rank": 0,
            "restart": 0,
            "ts": "2026-12-01T10:00:05Z",
            "timeouts_s": {"forward": 5.0, "data": 7.5},
            "heartbeat_timeout_s": 10.4,
            "pinned": ["step"],
        },
    ]
    (logs / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    rep = analyze(tmp_path)
    assert rep.hang_timeouts == {"forward": 5.0, "data": 7.5, "heartbeat": 10.4}
    assert rep.hang_pinned == ["step"]
    assert "learned: forward 5 s, data 7.5 s, heartbeat 10.4 s; pinned: step" in format_report(rep)


def test_rank_0_agrees_with_the_restored_table_before_the_others_publish_again() -> None:
    """Right after a resume a peer's published table may still be the one from before its
    load (all unknown): rank 0 counts the checkpoint's table for it, so the group keeps the
    restored timeouts instead of falling back to the fixed ones for a round."""
    import torch.distributed as dist

    store = dist.HashStore()
    c = cfg(learn_floor_s=1.0)
    sd = {"timeouts": {"forward": 2.5}, "world_size": 2}
    ranks = [LearnedTimeouts(c, world_size=2) for _ in range(2)]
    unknown = np.full(len(Phase), math.nan).tobytes()
    store.set(storekeys.learned(1), unknown)  # type: ignore[arg-type]  # before its load
    for lt in ranks:
        lt.load_state_dict(sd)
    p = Progress()
    p.stats = PhaseStats()
    agreed = ranks[0].exchange(store, 0, p, world_size=2)
    assert agreed is not None and agreed[Phase.FORWARD] == 2.5
    assert ranks[1].exchange(store, 1, p, world_size=2) is None
    assert ranks[1].agreed[Phase.FORWARD] == 2.5  # read back for its saves


@pytest.mark.extended  # about 40 s under resilient run
@pytest.mark.timeout(240)
def test_a_hot_replaced_group_judges_by_the_learned_timeouts_at_once(tmp_path: Path) -> None:
    """A stall at step 72 is replaced hot; a second one 8 steps into generation 1 (before
    its own 10-step warm-up) is named by the table the snapshot carried, not by 300 s."""
    from helpers import Launcher, run_cmd, run_events

    from resilient.proctree import alive

    run = tmp_path / "run"
    argv = ["--nproc-per-node", "2", "--run-dir", str(run), "--monitor-interval", "0.1"]
    argv += ["--hot-recovery", "-m", "chaos.inject", "--fault", "hang@rank=1,step=72,phase=forward"]
    argv += [
        "--fault",
        "hang@rank=0,step=80,phase=forward,generation=1",
        "--",
        "chaos/paced_train.py",
    ]
    argv += ["--step-s", "0.1", "--steps", "100", "--save-every", "10"]
    argv += ["--ckpt-dir", str(tmp_path / "ckpt"), "--run-dir", str(run)]
    env = {
        "RESILIENT_WATCHDOG": json.dumps({"learn_warmup_steps": 10}),
        "RESILIENT_SNAPSHOT": json.dumps({"enabled": True, "every_steps": 1}),
    }
    launcher = Launcher()
    try:
        code, _, err = launcher.run(run_cmd(*argv), timeout=200, env=env)
    finally:
        launcher.close()
    assert not [e for e in run_events(run, "runtime.init") if alive(int(e["pid"]))]
    assert code == 0, err[-3000:]
    first, second = (e["named"][0] for e in run_events(run, "hang.detected"))
    assert (first["rank"], first["timeout_kind"], first["timeout_s"]) == (1, "learned", 5.0)
    assert (second["rank"], second["step"]) == (0, 80)
    assert (second["timeout_kind"], second["timeout_s"]) == ("learned", 5.0), second


def test_the_default_floor_follows_a_long_heartbeat_interval() -> None:
    """A config that only lengthens the heartbeat interval stays valid: the floor follows it."""
    c = WatchdogConfig(heartbeat_interval_s=10.0, heartbeat_timeout_s=30.0)
    assert c.learn_floor_s == 10.0
    assert WatchdogConfig().learn_floor_s == 5.0


def test_a_block_of_an_unlearned_phase_holds_the_phases_its_code_passes_through() -> None:
    """An evaluation through the tracked model enters forward and backward inside
    rt.phase("eval"): those intervals stay out of the statistics, and the heartbeat says the
    rank is held (FLAG_HELD), so a peer waiting on it keeps the fixed timeouts."""
    p = Progress()
    p.stats = PhaseStats()
    p.flags |= FLAG_WARM
    p.enter(Phase.STEP)
    held = p.hold(Phase.EVAL)
    assert not held and p.flags & FLAG_HELD
    p.enter(Phase.FORWARD)  # the eval's forward, through the instrumented model
    p.enter(Phase.BACKWARD)
    p.resume(Phase.STEP)
    p.release(held)
    assert not p.flags & FLAG_HELD
    assert p.stats.count(Phase.FORWARD) == 0 and p.stats.count(Phase.BACKWARD) == 0
    assert not p.hold(Phase.FORWARD) and not p.flags & FLAG_HELD  # a learned phase: no hold

    clock = [0.0]
    sim = Sim(2)
    det = _learned_detector(2)
    det._clock = lambda: clock[0]
    step = _ddp_stall(sim, 10.0, sleeper=0)

    def evaluating(now: float) -> None:  # rank 0 evaluates, forwards ticking, rank 1 waits
        step(now)
        if now >= 10.0:
            sim.set(0, now, phase=Phase.FORWARD, step=9, seq=2000 + int(now / IV))
            sim.progress[0].flags |= FLAG_HELD

    _, found = run_until_detection(det, sim, clock, 29.0, evaluating)
    assert found is None  # rank 1 waited 19 s against a learned 5 s
