"""No false alarm (issue 50): chaos/scenarios/quiet/slow_events.toml, a healthy 2-rank run
whose learned hang timeouts meet a 20x step, a slow evaluation on one rank and a slow
checkpoint, must end without a verdict (chaos/quiet.py); the seeded soak draws stay within
the learned rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.quiet import QuietScenario, draw, run

SCENARIO = (
    Path(__file__).resolve().parents[1] / "chaos" / "scenarios" / "quiet" / "slow_events.toml"
)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_slow_but_legitimate_events_draw_no_verdict(tmp_path: Path) -> None:
    sc = QuietScenario.load(SCENARIO)
    res = run(sc, tmp_path)
    assert res["ok"], res
    learned = res["learned_s"]
    assert learned["forward"] == 1.5  # the floor: 10 x a 30 ms forward is less
    lengths = {e["kind"]: e["length_s"] for e in res["events"]}
    # the eval and the save last twice the learned timeouts: their phases keep the fixed ones
    assert lengths["eval"] > max(learned.values()) and lengths["slow_save"] > max(learned.values())
    assert lengths["slow_step"] == pytest.approx(20 * sc.step_s)


def test_the_soak_draws_events_the_rule_allows() -> None:
    for sc in draw(seed=7, runs=30):
        (slow,) = [e for e in sc.events if e.kind == "slow_step"]
        assert slow.factor >= 5
        assert slow.factor * sc.step_s <= 0.8 * max(1.5, 10 * sc.step_s) + 1e-9
        assert sorted(e.kind for e in sc.events) == ["eval", "slow_save", "slow_step"]
