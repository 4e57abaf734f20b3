"""No false alarms: healthy runs with slow but legitimate events, where the learned hang
timeouts (resilient/hang/learned.py) must never fire.

    python -m chaos.quiet run chaos/scenarios/quiet/slow_events.toml
    python -m chaos.quiet soak --seed 2026 --runs 40        seeded draws (make soak)

A scenario (TOML, in chaos/scenarios/quiet/: the fault matrix of `python -m chaos` does not
read that folder) is a `resilient run` of `nproc` ranks (2) of chaos/paced_train.py, each
step's forward about `step_s`, rank 0 evaluating alone every `eval_every` steps, a
checkpoint every `save_every` steps, with `[watchdog]` settings, and events injected by
chaos.inject:

    [[event]]
    kind = "slow_step"   # one rank's forward, once, `factor` x the step time longer
    rank = 1             #   (a GC pause, a noisy neighbour)
    at_step = 60
    factor = 20
    [[event]]
    kind = "eval"        # rank 0's evaluation at `at_step` (a multiple of eval_every) takes
    at_step = 90         #   `seconds` longer in its first forward through the tracked model
                         #   (phase forward, inside rt.phase("eval")); the other rank waits
                         #   for it in the all-reduce
    seconds = 3
    [[event]]
    kind = "slow_save"   # one rank's checkpoint of step `at_step` (a multiple of save_every)
    rank = 1             #   takes `seconds` longer: a throttled store
    at_step = 120
    seconds = 3
    [[event]]
    kind = "resize"      # a second node joins once rank 0 has done `at_step` steps and
    at_step = 140        #   learned its timeouts (chaos/quiet_resize.py): the world doubles
    seconds = 3          #   through torch elastic's membership change, and the new world's
                         #   first step and one warm-up step take `seconds` longer (one
                         #   resize at most, after the other events)

The checks: the run ends 0 in one attempt (with a resize: two, the second on both nodes,
after the agent's `restart.membership`); no verdict anywhere (hang.detected, fault.detected,
watchdog.exit, a recovery) and no other restart; every event fired; and learned timeouts
were in force before the first event (rank 0's hang.timeouts), so the events met them: none
is vacuous. A resize adds its own checks (chaos/quiet_resize.py). The result lists the
learned table and each event's length against it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos import quiet_resize
from chaos.procs import REPO, Run
from resilient.events import read_events, timestamp
from resilient.hang.config import WatchdogConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["Event", "QuietScenario", "check", "draw", "run"]

KINDS = ("slow_step", "eval", "slow_save", "resize")
VERDICTS = (
    "hang.detected",
    "fault.detected",
    "watchdog.exit",
    "recovery.cold",
    "recovery.hot.formed",
    "rollback.done",
)
RESTARTS = ("worker.failed", "restart.decided", "restart.kill_survivors", "restart.backoff")
"""A restart for a failure: a resize's membership change is the only restart allowed."""


@dataclass(kw_only=True, slots=True)
class Event:
    kind: str
    at_step: int
    rank: int = 0
    factor: float = 20.0
    """slow_step: how many step times longer its forward takes."""
    seconds: float = 3.0
    """eval, slow_save: how long it takes (or longer); resize: how much longer the new
    world's first step and one of its warm-up steps take."""

    def specs(self, sc: QuietScenario) -> list[str]:
        """The chaos.inject faults that make it (chaos/faults.py)."""
        if self.kind == "slow_step":
            secs = self.factor * sc.step_s
            return [f"slow@rank={self.rank},step={self.at_step},phase=forward,seconds={secs:g}"]
        if self.kind == "eval":  # its first forward, after the step's own (skip=1)
            where = f"rank=0,step={self.at_step},phase=forward,skip=1"
            return [f"slow@{where},seconds={self.seconds:g}"]
        if self.kind == "resize":  # the join itself is the driver's (quiet_resize.run_resized)
            return quiet_resize.specs(sc.nproc, self.seconds)
        # the save after step index at_step - 1 completes: progress still says that step
        at = self.at_step - 1
        return [f"slow@rank={self.rank},step={at},phase=checkpoint,seconds={self.seconds:g}"]

    @property
    def length_s(self) -> float:
        return self.seconds


@dataclass(kw_only=True, slots=True)
class QuietScenario:
    name: str
    step_s: float = 0.03
    steps: int = 160
    eval_every: int = 10
    save_every: int = 40
    nproc: int = 2
    """Ranks per node (a resize adds a second node of as many)."""
    timeout_s: float = 120.0
    watchdog: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        for e in self.events:
            if e.kind not in KINDS:
                raise ValueError(f"{self.name}: unknown event {e.kind!r}; known: {KINDS}")
            if not 0 < e.at_step < self.steps:
                raise ValueError(f"{self.name}: event at step {e.at_step} outside the run")
            if e.kind == "eval" and (not self.eval_every or e.at_step % self.eval_every):
                raise ValueError(f"{self.name}: no evaluation at step {e.at_step}")
            if e.kind == "slow_save" and e.at_step % self.save_every:
                raise ValueError(f"{self.name}: no checkpoint at step {e.at_step}")
        resize = self.resize
        # the new world is numbered afresh: the others' ranks and steps would mean
        # something else after it
        if resize is not None and (
            [e for e in self.events if e.kind == "resize"] != [resize]
            or any(e.at_step >= resize.at_step for e in self.events if e is not resize)
        ):
            raise ValueError(f"{self.name}: one resize, after every other event")

    @property
    def resize(self) -> Event | None:
        return next((e for e in self.events if e.kind == "resize"), None)

    @classmethod
    def load(cls, path: Path) -> QuietScenario:
        raw = tomllib.loads(path.read_text())
        events = [Event(**e) for e in raw.pop("event", [])]
        return cls(**raw, events=events)


def run(sc: QuietScenario, out: Path) -> dict[str, Any]:
    """Run the scenario in `out`; returns the result with its checks ("ok": all passed)."""

    def argv(run_dir: Path, rendezvous: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "resilient.cli", "run", "--nproc-per-node", str(sc.nproc)]
        cmd += [*rendezvous, "--run-dir", str(run_dir), "--monitor-interval", "0.1"]
        cmd += ["--max-restarts", "0", "-m", "chaos.inject"]
        cmd += [a for e in sc.events for s in e.specs(sc) for a in ("--fault", s)]
        cmd += ["--", str(REPO / "chaos" / "paced_train.py"), "--step-s", str(sc.step_s)]
        cmd += ["--steps", str(sc.steps), "--eval-every", str(sc.eval_every)]
        cmd += ["--save-every", str(sc.save_every), "--ckpt-dir", str(out / "ckpt")]
        return [*cmd, "--run-dir", str(run_dir)]

    env = {"RESILIENT_WATCHDOG": json.dumps(sc.watchdog)}
    t0 = time.monotonic()
    resize = sc.resize
    if resize is None:
        with Run(argv(out / "run", []), log_path=out / "launcher.log", env=env) as launched:
            codes: list[int | None] = [launched.wait(sc.timeout_s)]
    else:
        codes = quiet_resize.run_resized(sc.name, resize.at_step, out, argv, env, sc.timeout_s)
    result = check(sc, [out / "run", out / "run-B"][: len(codes)], codes)
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


def check(sc: QuietScenario, run_dirs: list[Path], codes: list[int | None]) -> dict[str, Any]:
    """The checks over every node's events (the module doc); `codes`: each node's exit."""
    evs = [e for d in run_dirs for e in read_events(d)]
    verdicts = [e for e in evs if e.get("event") in VERDICTS]
    restarts = [e for e in evs if e.get("event") in RESTARTS]
    fired = [e for e in evs if e.get("event") == "chaos.fault"]
    learned = sorted(
        (e for e in evs if e.get("event") == "hang.timeouts" and e.get("rank") == 0),
        key=timestamp,
    )
    first_fault = min((timestamp(e) for e in fired), default=None)
    before = [e for e in learned if first_fault is not None and timestamp(e) < first_fault]
    table = dict(before[-1]["timeouts_s"]) if before else {}
    attempts = [e for e in evs if e.get("event") == "attempt.start"]
    # a resize's join is an event of the driver's (node_join), besides its in-process faults
    expected = sum(len(e.specs(sc)) + (e.kind == "resize") for e in sc.events)
    checks = {
        "exit 0": codes == [0] * len(codes),
        "no verdict": not verdicts,
        "no restart for a failure": not restarts,
        "every event fired": len(fired) == expected,
        "learned timeouts in force before the events": bool(table),
    }
    facts: dict[str, Any] = {}
    if sc.resize is None:
        checks["one attempt"] = len(attempts) == 1
    else:
        warmup = WatchdogConfig(**sc.watchdog).learn_warmup_steps
        more, facts = quiet_resize.check_resize(evs, sc.nproc, sc.steps, warmup)
        checks.update(more)
    return {
        "name": sc.name,
        "ok": all(checks.values()),
        "checks": checks,
        "verdicts": [{k: e.get(k) for k in ("event", "kind", "ranks", "rank")} for e in verdicts],
        "restarts": [e.get("event") for e in restarts],
        "learned_s": table,
        "resize": facts,
        "events": [
            {
                **asdict(e),
                "length_s": round(e.factor * sc.step_s if e.kind == "slow_step" else e.seconds, 3),
            }
            for e in sc.events
        ],
        "step_s": sc.step_s,
    }


def draw(seed: int, runs: int) -> list[QuietScenario]:
    """`runs` seeded scenarios: a step time of 10, 30 or 100 ms, a slow step on a random
    rank of 5x up to 0.8 of the learned rule, max(floor, factor x step) (120x at 10 ms, 8x
    at 100 ms), a slow evaluation and a slow checkpoint of 2-4 s, in random order after the
    warm-up; in about a quarter (a draw of its own, so the others stay as they were), a
    resize after those, with slow steps of 2-4 s in the new world."""
    rng = random.Random(seed)
    watchdog = {"heartbeat_interval_s": 0.25, "learn_floor_s": 1.5, "learn_warmup_steps": 10}
    out = []
    for i in range(runs):
        step_s = rng.choice((0.01, 0.03, 0.1))
        warm = 10 + int(6.0 / step_s)  # the warm-up, then the agreement (every 2 s)
        steps = warm + 60
        limit = max(1.5, 10 * step_s)
        factor = rng.uniform(5.0, 0.8 * limit / step_s)
        slots = rng.sample(range(warm // 10 + 1, steps // 10 - 1), 3)
        kinds = ["slow_step", "eval", "slow_save"]
        events = [
            Event(
                kind=k,
                at_step=10 * s,
                rank=rng.randint(0, 1),
                factor=round(factor, 1),
                seconds=round(rng.uniform(2.0, 4.0), 1),
            )
            for k, s in zip(kinds, slots, strict=True)
        ]
        grow = random.Random(f"{seed}-{i}-resize")
        if grow.random() < 0.25:
            events.append(Event(kind="resize", at_step=steps, seconds=grow.choice((2, 3, 4))))
            # the join (1-2 s), the new warm-up, then the agreement (up to two 2 s rounds)
            steps += 10 + int(10.0 / step_s)
        out.append(
            QuietScenario(
                name=f"quiet-{seed}-{i}",
                step_s=step_s,
                steps=steps,
                eval_every=10,
                save_every=10,
                watchdog=watchdog,
                events=events,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.quiet", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="run directories (default: a temp dir)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("files", nargs="+", type=Path)
    s = sub.add_parser("soak")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--runs", type=int, default=40)
    args = p.parse_args(argv)
    scenarios = (
        [QuietScenario.load(f) for f in args.files]
        if args.cmd == "run"
        else draw(args.seed, args.runs)
    )
    root = args.out or Path(tempfile.mkdtemp(prefix="chaos-quiet-"))
    failed = 0
    for sc in scenarios:
        (root / sc.name).mkdir(parents=True, exist_ok=True)
        res = run(sc, root / sc.name)
        failed += not res["ok"]
        bad = [k for k, v in res["checks"].items() if not v]
        print(
            f"{sc.name}: {'ok' if res['ok'] else 'FAILED ' + str(bad)}  step {sc.step_s:g} s, "
            f"learned {res['learned_s']}, events "
            + ", ".join(f"{e['kind']} {e['length_s']} s" for e in res["events"])
            + (f", resize {res['resize']}" if res["resize"] else "")
            + f"  ({res['seconds']} s)"
            + (
                f"  verdicts {res['verdicts']}, restarts {res['restarts']}; kept in "
                f"{root / sc.name}"
                if not res["ok"]
                else ""
            ),
            flush=True,
        )
    print(f"chaos.quiet: {len(scenarios) - failed} passed, {failed} failed, 0 verdicts allowed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
