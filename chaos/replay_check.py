"""Invariant (f): the steps a restart ran again are the steps it had run before.

After every resume from a checkpoint, each rank replays the steps between that checkpoint
and the fault. Their fingerprints (resilient/replay/fingerprint.py: the first forward inputs
of the step, and the loss when handed over) must equal the earlier attempt's, and the runtime's
own online check must not have logged `resume.diverged`. This reads the ranks' logs itself
(resilient.replay.compare.across_attempts), so it does not rely on the check it verifies.

A bitflip is the exception: the attempt it hit ran the steps from the flip to the replica
check that saw it on a corrupted replica, so their losses are no reference for the replay.
`corrupted` names them (attempt -> steps): their fingerprints are left out of the
comparison, and a `resume.diverged` among them is expected, not a failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from resilient import events as ev
from resilient.replay.compare import across_attempts

__all__ = ["check_replay"]


def _without(events: Iterable[dict[str, Any]], corrupted: dict[int, range]) -> list[dict[str, Any]]:
    """One rank's events less the fingerprints of `corrupted` steps of each attempt (the
    attempt counted by runtime.init of generation 0, as chaos/plan.py counts them)."""
    out, attempt = [], -1
    for e in events:
        if e.get("event") == ev.RUNTIME_INIT and int(e.get("generation") or 0) == 0:
            attempt += 1
        if e.get("event") == ev.STEP_FINGERPRINT and int(e["step"]) in corrupted.get(
            attempt, range(0)
        ):
            continue
        out.append(e)
    return out


def check_replay(run_dir: Path, corrupted: dict[int, range] | None = None) -> tuple[str, list[str]]:
    """(the check's summary, failures) for a finished run."""
    corrupted = corrupted or {}
    failures: list[str] = []
    compared = 0
    for path in sorted((run_dir / "logs").glob("rank*.jsonl")):
        n, div = across_attempts(_without(ev.read_events(path), corrupted))
        compared += n
        if div is not None:
            failures.append(f"f: {path.stem}: {div.describe()}")
    window = {s for steps in corrupted.values() for s in steps}
    expected = []
    for e in ev.read_events(run_dir, ev.RESUME_DIVERGED, pattern="rank*.jsonl"):
        if int(e.get("step", -1)) in window:  # the earlier run was the corrupted one
            expected.append(f"rank {e.get('rank')} at {e.get('step')}")
            continue
        failures.append(
            f"f: rank {e.get('rank')} logged resume.diverged at step {e.get('step')} "
            f"({e.get('differed')} differ)"
        )
    verified = sum(
        int(e.get("steps", 0))
        for e in ev.read_events(run_dir, ev.RESUME_VERIFIED, pattern="rank*.jsonl")
    )
    summary = f"{compared} replayed step(s) compared, {verified} verified online"
    if corrupted:
        summary += f"; steps {sorted(window)} run on a corrupted replica not compared" + (
            f", resume.diverged there as expected: {', '.join(expected)}" if expected else ""
        )
    return ("fail (" + summary + ")" if failures else "pass (" + summary + ")"), failures
