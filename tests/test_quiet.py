"""No false alarm (issue 50): chaos/scenarios/quiet/slow_events.toml, a healthy 2-rank run
whose learned hang timeouts meet a 20x step, a slow evaluation on one rank and a slow
checkpoint, must end without a verdict (chaos/quiet.py); so must resize.toml, whose world
grows from 2 to 4 ranks mid-run (chaos/quiet_resize.py); the seeded soak draws stay within
the learned rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.quiet import QuietScenario, draw, run

SCENARIOS = Path(__file__).resolve().parents[1] / "chaos" / "scenarios" / "quiet"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_slow_but_legitimate_events_draw_no_verdict(tmp_path: Path) -> None:
    sc = QuietScenario.load(SCENARIOS / "slow_events.toml")
    res = run(sc, tmp_path)
    assert res["ok"], res
    learned = res["learned_s"]
    assert learned["forward"] == 1.5  # the floor: 10 x a 30 ms forward is less
    lengths = {e["kind"]: e["length_s"] for e in res["events"]}
    # the eval and the save last twice the learned timeouts: their phases keep the fixed ones
    assert lengths["eval"] > max(learned.values()) and lengths["slow_save"] > max(learned.values())
    assert lengths["slow_step"] == pytest.approx(20 * sc.step_s)


@pytest.mark.extended  # 33-36 s with two nodes: make soak; CI runs slow_events above
@pytest.mark.timeout(200)
def test_an_elastic_resize_draws_no_verdict(tmp_path: Path) -> None:
    """A second node joins a learned run: the only restart is the agent's membership change
    (`restart.membership`), the new world's steps are judged by the first-step and fixed
    timeouts until it has learned its own, and the run ends 0 at its last step."""
    sc = QuietScenario.load(SCENARIOS / "resize.toml")
    assert sc.resize is not None
    res = run(sc, tmp_path)  # run_resized kills both nodes' trees when it returns
    assert res["ok"], res
    assert res["verdicts"] == [] and res["restarts"] == []
    resize = res["resize"]
    assert resize["worlds"] == [2, 4]
    assert resize["steps_lost"] == 0  # the membership stop saved at the step it stopped
    assert resize["resumed_at"] > sc.resize.at_step
    # the old world's table (the floor) was in force before; the new world's steps of 3 s,
    # twice it, passed: its first step and one inside the new warm-up
    old = res["learned_s"]
    assert old and max(old.values()) == 1.5
    (ev,) = res["events"]
    assert ev["length_s"] > 2 * max(old.values()) - 1e-9
    # ...and a table learned again, at least a warm-up after the resume, was in force after
    assert set(resize["learned_after_s"]) == set(old)
    assert resize["relearned_at_step"] < sc.steps


def test_the_soak_draws_events_the_rule_allows() -> None:
    draws = draw(seed=7, runs=30)
    for sc in draws:
        (slow,) = [e for e in sc.events if e.kind == "slow_step"]
        assert slow.factor >= 5
        assert slow.factor * sc.step_s <= 0.8 * max(1.5, 10 * sc.step_s) + 1e-9
        kinds = sorted(e.kind for e in sc.events if e.kind != "resize")
        assert kinds == ["eval", "slow_save", "slow_step"]
        if sc.resize is not None:  # last, with a tail long enough to learn again
            assert all(e.at_step < sc.resize.at_step for e in sc.events if e.kind != "resize")
            assert sc.steps - sc.resize.at_step >= 10 + 10.0 / sc.step_s - 1
    assert 0 < sum(sc.resize is not None for sc in draws) < 15  # about a quarter
