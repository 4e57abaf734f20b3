"""Invariant (f): the steps a restart ran again are the steps it had run before.

After every resume from a checkpoint, each rank replays the steps between that checkpoint
and the fault. Their fingerprints (resilient/replay/fingerprint.py: the first forward inputs
of the step, and the loss when handed over) must equal the earlier attempt's, and the runtime's
own online check must not have logged `resume.diverged`. This reads the ranks' logs itself
(resilient.replay.compare.across_attempts), so it does not rely on the check it verifies.
"""

from __future__ import annotations

from pathlib import Path

from resilient import events as ev
from resilient.replay.compare import across_attempts

__all__ = ["check_replay"]


def check_replay(run_dir: Path) -> tuple[str, list[str]]:
    """(the check's summary, failures) for a finished run."""
    failures: list[str] = []
    compared = 0
    for path in sorted((run_dir / "logs").glob("rank*.jsonl")):
        n, div = across_attempts(ev.read_events(path))
        compared += n
        if div is not None:
            failures.append(f"f: {path.stem}: {div.describe()}")
    for e in ev.read_events(run_dir, ev.RESUME_DIVERGED, pattern="rank*.jsonl"):
        failures.append(
            f"f: rank {e.get('rank')} logged resume.diverged at step {e.get('step')} "
            f"({e.get('differed')} differ)"
        )
    verified = sum(
        int(e.get("steps", 0))
        for e in ev.read_events(run_dir, ev.RESUME_VERIFIED, pattern="rank*.jsonl")
    )
    summary = f"{compared} replayed step(s) compared, {verified} verified online"
    return ("fail (" + summary + ")" if failures else "pass (" + summary + ")"), failures
