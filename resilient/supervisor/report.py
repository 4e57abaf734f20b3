"""What the supervisor knows about a run: worker event logs, checkpoint progress, failures.

Sources, best first: the workers' JSON event logs under <run_dir>/logs (guard.failure,
worker.exception, hang.detected, fault.detected, watchdog.exit carry the rank, the step and the
error), torch elastic's per-rank error files (written by `@record` or by resilient's
excepthook), and the exit code itself. The final report goes to <run_dir>/supervisor_report.json.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilient.events import STEP_FINGERPRINT, EventTail
from resilient.exitcodes import ExitCode, describe

__all__ = [
    "AttemptRecord",
    "CheckpointProbe",
    "EventLogs",
    "RankFailure",
    "SupervisorReport",
    "repeating_failure",
]

REPORT_NAME = "supervisor_report.json"
# Events that say why a rank left, in order of preference when several name the same pid.
_CAUSE_EVENTS = (
    "guard.failure",
    "worker.exception",
    "hang.detected",
    "fault.detected",
    "watchdog.exit",
)


class EventLogs:
    """Reads the ranks' JSON-lines logs under <run_dir>/logs incrementally (new lines only)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(run_dir) / "logs"
        self._tail = EventTail(self.dir, "rank*.jsonl")
        self.records: list[dict[str, Any]] = []

    def refresh(self) -> list[dict[str, Any]]:
        """Read what the ranks appended since the last call; returns the new records."""
        # one fingerprint per step and rank would grow without bound here; none is needed
        new = [r for r in self._tail.read_new() if r.get("event") != STEP_FINGERPRINT]
        self.records += new
        return new

    def named(self, *events: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") in events]

    def newest_committed(self) -> int | None:
        """The newest step a rank logged as committed or loaded (progress without a URL)."""
        steps = [
            int(r["step"])
            for r in self.named("ckpt.save.committed", "ckpt.load")
            if isinstance(r.get("step"), int)
        ]
        return max(steps) if steps else None

    def longest_save_s(self, last: int = 5) -> float | None:
        """The longest of the last few committed saves, in seconds (None: none logged)."""
        secs = [
            float(r["seconds"])
            for r in self.named("ckpt.save.committed")
            if isinstance(r.get("seconds"), int | float)
        ]
        return max(secs[-last:]) if secs else None


class CheckpointProbe:
    """The newest committed checkpoint step under a URL, as the supervisor's progress measure.

    Falls back to the workers' event logs when no URL is known or the listing fails.
    """

    def __init__(self, url: str | None, logs: EventLogs) -> None:
        self.url = url
        self.logs = logs
        self.error: str | None = None

    def __call__(self) -> int | None:
        self.logs.refresh()
        if self.url is not None:
            from resilient.checkpoint.manager import CheckpointConfig, CheckpointManager
            from resilient.errors import ResilientError

            try:
                infos = CheckpointManager(CheckpointConfig(url=self.url)).list()
            except (OSError, ResilientError) as e:  # counted as no progress, said in the report
                self.error = f"listing {self.url} failed: {e}"
            else:
                steps = [i.step for i in infos if i.committed]
                return max(steps) if steps else None
        return self.logs.newest_committed()


@dataclass(slots=True)
class RankFailure:
    """One rank's exit, with what the logs or error files say about it."""

    rank: int
    local_rank: int
    pid: int
    exit_code: int
    meaning: str
    root: bool
    """Exited on its own; False for a rank the supervisor stopped after the first failure."""
    error: str | None = None
    step: int | None = None
    phase: str | None = None
    source: str = "exit code"

    def signature(self) -> tuple[int, str, int | None]:
        """What identifies a repeating failure: (rank, error or exit code, step)."""
        what = self.error.splitlines()[0][:200] if self.error else f"exit code {self.exit_code}"
        return (self.rank, what, self.step)


@dataclass(slots=True)
class AttemptRecord:
    """One start of the worker group, until it ended."""

    restart: int
    attempt_id: str
    started_at: float
    world_size: int
    group_rank: int
    ended_at: float | None = None
    outcome: str = "running"
    failures: list[RankFailure] = field(default_factory=list)
    progress: int | None = None
    action: str | None = None
    delay_s: float | None = None

    def roots(self) -> list[RankFailure]:
        return [f for f in self.failures if f.root] or self.failures


def explain_failures(
    failures: Iterable[tuple[int, int, int, int, str | None, bool]], logs: EventLogs
) -> list[RankFailure]:
    """RankFailure records from (rank, local_rank, pid, exit_code, error_file_message, root).

    The error and step come from the rank's own events (matched by pid), else from the error
    file torch elastic collected, else the exit code alone.
    """
    logs.refresh()
    # (rank, pid): on a run directory shared by several hosts a pid alone may repeat
    by_pid: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rec in logs.named(*_CAUSE_EVENTS):
        if isinstance(rec.get("pid"), int) and isinstance(rec.get("rank"), int):
            by_pid.setdefault((rec["rank"], rec["pid"]), []).append(rec)
    out = []
    for rank, local_rank, pid, code, file_msg, root in failures:
        f = RankFailure(
            rank=rank,
            local_rank=local_rank,
            pid=pid,
            exit_code=code,
            meaning=describe(code),
            root=root,
        )
        events = sorted(
            by_pid.get((rank, pid), []), key=lambda r: _CAUSE_EVENTS.index(str(r.get("event")))
        )
        if events:
            ev = events[0]
            f.error = _event_error(ev)
            f.step = ev.get("step") if isinstance(ev.get("step"), int) else None
            f.phase = ev.get("phase") if isinstance(ev.get("phase"), str) else None
            f.source = f"event {ev.get('event')}"
        elif file_msg:
            f.error = _last_line(file_msg)
            f.source = "error file"
        out.append(f)
    return out


def _event_error(ev: dict[str, Any]) -> str:
    text = str(ev.get("event"))
    for key in ("error", "reason", "kind"):
        val = ev.get(key)
        if isinstance(val, str) and val:
            text = val
            break
    ranks = ev.get("ranks")
    if ev.get("event") != "guard.failure" and isinstance(ranks, list) and ranks:
        text += f" (ranks named: {ranks[:8]})"
    return text


def _last_line(message: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else message


def repeating_failure(attempts: list[AttemptRecord]) -> dict[str, Any] | None:
    """The most frequent root-failure signature over `attempts`, with how often it occurred."""
    sigs: Counter[tuple[int, str, int | None]] = Counter()
    for att in attempts:
        for sig in {f.signature() for f in att.roots()}:
            sigs[sig] += 1
    if not sigs:
        return None
    (rank, error, step), count = sigs.most_common(1)[0]
    return {"rank": rank, "error": error, "step": step, "attempts": count, "of": len(attempts)}


@dataclass(slots=True)
class SupervisorReport:
    """The supervisor's account of a run, written as JSON at the end (and after each failure)."""

    run_id: str
    run_dir: str
    command: list[str]
    filename: str = REPORT_NAME
    """supervisor_report.json; with several nodes, one per host (a shared run directory)."""
    started_at: float = field(default_factory=time.time)
    attempts: list[AttemptRecord] = field(default_factory=list)
    exit_code: int | None = None
    outcome: str = "running"
    reason: str | None = None
    repeating: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)
    """Each round's node checks (resilient.health.HealthReport.to_json), oldest first."""

    def finish(self, code: int, outcome: str, reason: str | None = None) -> None:
        self.exit_code = int(code)
        self.outcome = outcome
        self.reason = reason

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.exit_code is not None:
            d["exit_meaning"] = describe(self.exit_code)
        return d

    def write(self) -> Path:
        path = Path(self.run_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=str))
        tmp.replace(path)
        return path

    def summary(self) -> str:
        """A few readable lines for the console."""
        code = self.exit_code if self.exit_code is not None else -1
        lines = [f"resilient run: {self.outcome}, exit code {code} ({_name(code)})"]
        if self.reason:
            lines.append(f"  {self.reason}")
        failed = [a for a in self.attempts if a.failures and a.outcome == "failed"]
        if failed:
            last = failed[-1]
            for f in last.roots()[:4]:
                where = f" at step {f.step}" if f.step is not None else ""
                lines.append(
                    f"  last failure: rank {f.rank} exit {f.exit_code}{where}: "
                    f"{f.error or f.meaning}"
                )
        last_health = self.health[-1] if self.health else {}
        for c in last_health.get("checks", []):
            if not c.get("ok", True):
                lines.append(
                    f"  health check {c.get('name')} failed: {c.get('value')} "
                    f"(needs {c.get('threshold')}); {c.get('detail')}"
                )
        lines.append(
            f"  attempts: {len(self.attempts)}; report: {Path(self.run_dir) / self.filename}"
        )
        return "\n".join(lines)


def _name(code: int) -> str:
    try:
        return ExitCode(code).name
    except ValueError:
        return "signal" if code < 0 or code > 128 else "other"
