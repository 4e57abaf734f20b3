"""The event log's vocabulary and its readers.

Every event is one JSON object per line in `<run_dir>/logs/*.jsonl` (`rank<R>.jsonl` per
rank, `supervisor*.jsonl`, `chaos.jsonl`), written by `resilient.log`. This module names the
events that something reads back (the report, the supervisor, the chaos checker, the replay
verification, the tests), and is the one place that parses those files: a line cut short by
a kill, or anything that is not a JSON object, is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Collection, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = [
    "CHAOS_FAULT",
    "CKPT_FALLBACK",
    "CKPT_FRESH_START",
    "CKPT_LOAD",
    "CKPT_SAVE_COMMITTED",
    "CKPT_SAVE_STAGED",
    "CKPT_SAVE_START",
    "DETECTION",
    "EXPORT_DONE",
    "EXPORT_FAILED",
    "EXPORT_START",
    "EXPORT_VERIFIED",
    "GRADS_CARRIED",
    "HANG_DETECTED",
    "HANG_TIMEOUTS",
    "HEALTH_CHECK",
    "HEALTH_DONE",
    "NODE_EXCLUDED",
    "OOM_RETRY",
    "PREEMPT_EXIT",
    "PREEMPT_STOP",
    "RECOVERY_COLD",
    "RECOVERY_HOT_AWAIT",
    "RECOVERY_HOT_DETECT",
    "RECOVERY_HOT_FORMED",
    "RECOVERY_HOT_FRAMEWORK_RESET",
    "RECOVERY_HOT_KILL",
    "RECOVERY_HOT_REPLACE",
    "RECOVERY_HOT_SEVER",
    "RECOVERY_HOT_SPARE",
    "RECOVERY_HOT_STUCK",
    "REPLAY_UNHOOKED",
    "RESUME_DIVERGED",
    "RESUME_UNVERIFIED",
    "RESUME_VERIFIED",
    "ROLLBACK_AGREED",
    "ROLLBACK_DONE",
    "ROLLBACK_REFUSED",
    "RUNTIME_DIGEST",
    "RUNTIME_DONE",
    "RUNTIME_INIT",
    "RUNTIME_RESUME",
    "STEP_FINGERPRINT",
    "STRAGGLER_DETECTED",
    "STRAGGLER_SCORES",
    "TRAIN_LOOP",
    "TRAIN_PROGRESS",
    "WORKER_FAILED",
    "EventTail",
    "iter_events",
    "latest_event",
    "parse_lines",
    "read_events",
    "timestamp",
]

# runtime
RUNTIME_INIT = "runtime.init"
"""A rank started: world_size, backend, host, pid, restart."""
RUNTIME_RESUME = "runtime.resume"
"""steps() resumed: step, from_checkpoint."""
RUNTIME_DONE = "runtime.done"
"""steps() or epochs() ended normally: step, total."""
RUNTIME_DIGEST = "runtime.digest"
"""The final state's sha256 (only when $RESILIENT_FINAL_DIGEST is set: check-resume)."""
TRAIN_PROGRESS = "train.progress"
TRAIN_LOOP = "train.loop"
"""A step loop begins: start (the resumed step) and total (where it ends)."""
"""A window of completed steps: first, last, t0, t1, t1_first, busy_s."""
STEP_FINGERPRINT = "step.fingerprint"
"""Completed steps' fingerprints: first, inputs (one hash per step), loss (or None), world."""
RESUME_VERIFIED = "resume.verified"
"""Every replayed step matched the earlier attempt's fingerprint: steps (the count)."""
RESUME_DIVERGED = "resume.diverged"
"""A replayed step differed from the earlier attempt: step, differed, likely causes."""
RESUME_UNVERIFIED = "resume.unverified"
"""A resume that could not be compared (no earlier fingerprints, another world size)."""
GRADS_CARRIED = "grads.carried"
"""A non-zero .grad at the first save's step boundary was still there at the next backward
(resilient/replay/grads.py): step (the save's), param (one such name), held (how many)."""
REPLAY_UNHOOKED = "replay.unhooked"
"""The tracked model's forward never ran in a step: its inputs go unfingerprinted."""
# checkpoints
CKPT_SAVE_START = "ckpt.save.start"
CKPT_SAVE_STAGED = "ckpt.save.staged"
CKPT_SAVE_COMMITTED = "ckpt.save.committed"
CKPT_LOAD = "ckpt.load"
CKPT_FALLBACK = "ckpt.fallback"
CKPT_FRESH_START = "ckpt.fresh_start"
# resilient export (resilient/weights/export.py)
EXPORT_START = "export.start"
"""An export began: src (the checkpoint), dst, step, format, tensors, bytes (to write)."""
EXPORT_VERIFIED = "export.verified"
"""Every file of the checkpoint matched its manifest, before anything was written: files,
bytes (read), seconds."""
EXPORT_DONE = "export.done"
"""An export is in place: dst, files, tensors, bytes, seconds, and its parts (verify_s,
read_s, write_s)."""
EXPORT_FAILED = "export.failed"
"""An export stopped with nothing under its final name: error."""
# faults, detection and preemption
HANG_DETECTED = "hang.detected"
HANG_TIMEOUTS = "hang.timeouts"
"""Rank 0's watchdog, when the agreed learned timeouts change (by over 10 %): timeouts_s
{phase: seconds} (hang/learned.py), and the phases `phase_timeouts_s` pins (never learned);
the live metrics export them."""
WORKER_FAILED = "worker.failed"
DATA_FORK_DEADLOCK_PRONE = "data.fork_deadlock_prone"
"""A tracked loader forks its workers on an interpreter that can deadlock a forked child
(CPython gh-112275; data/worker_start.py): num_workers, named_after_s (when the watchdog names
a worker stuck in its fork; None with the watchdog off), fix (what to upgrade to)."""
PREEMPT_STOP = "preempt.stop"
PREEMPT_EXIT = "preempt.exit"
CHAOS_FAULT = "chaos.fault"
# the node's health and its ranks' pace (resilient run: live metrics, exclusion, eviction)
STRAGGLER_SCORES = "straggler.scores"
"""Local rank 0 of a node, every few seconds: scores {rank: median pace / its pace} of every
warm rank, and node_ranks (the global ranks of its node)."""
STRAGGLER_DETECTED = "straggler.detected"
HEALTH_CHECK = "health.check"
"""The supervisor ran one node check: name, ok, skipped, value, threshold, seconds."""
HEALTH_DONE = "health.done"
"""All of a round's node checks: ok, seconds, failed (names)."""
NODE_EXCLUDED = "node.excluded"
"""This node leaves the job before a rendezvous round: reason (health or straggler), detail."""
# recoveries without a restart (resilient report tells them from cold restarts)
ROLLBACK_AGREED = "rollback.agreed"
ROLLBACK_REFUSED = "rollback.refused"
ROLLBACK_DONE = "rollback.done"
OOM_RETRY = "oom.retry"
RECOVERY_HOT_AWAIT = "recovery.hot.await"
"""A hot verdict named a stalled or silent peer: this rank stays and waits to meet the loss."""
RECOVERY_HOT_DETECT = "recovery.hot.detect"
RECOVERY_HOT_REPLACE = "recovery.hot.replace"
RECOVERY_HOT_FORMED = "recovery.hot.formed"
RECOVERY_HOT_FRAMEWORK_RESET = "recovery.hot.framework_reset"
"""A survivor emptied a framework's process-state singletons before running the script
again (Accelerate's; resilient/hot/framework_state.py)."""
RECOVERY_HOT_KILL = "recovery.hot.kill"
"""An agent SIGKILLed its worker that a hot verdict named and that could not leave by itself."""
RECOVERY_HOT_SEVER = "recovery.hot.sever"
"""A rank still waiting in a collective of a generation that survivors already left cut its
connections to them, so that its collective fails and it goes hot too (hang/departed.py)."""
RECOVERY_HOT_SPARE = "recovery.hot.spare"
"""The agent started its next warm spare after a hot replacement (and why then)."""
RECOVERY_HOT_STUCK = "recovery.hot.stuck"
"""A rank whose main thread had not moved when the agent started the next generation said so
with its connections, so that its peers cut them and it goes hot too (hang/departed.py)."""
RECOVERY_COLD = "recovery.cold"
DETECTION = (
    HANG_DETECTED,
    "fault.detected",
    "watchdog.exit",
    "guard.failure",
    WORKER_FAILED,
    "preempt.forward",  # the supervisor passed a preemption signal on
    PREEMPT_STOP,  # the ranks agreed to stop for one
)
"""Events that mark a fault as seen (the report's time to detect)."""

Source = str | os.PathLike[str]
Names = str | Collection[str] | None


def _files(source: Source, rank: int | None, pattern: str) -> list[Path]:
    p = Path(source)
    if p.is_file() or p.suffix == ".jsonl":
        return [p]
    logs = p / "logs" if (p / "logs").is_dir() else p
    if rank is not None:
        return [logs / f"rank{rank}.jsonl"]
    return sorted(logs.glob(pattern))


def parse_lines(data: bytes | str) -> list[dict[str, Any]]:
    """The JSON objects of complete lines in `data` (torn or foreign lines skipped)."""
    out = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                out.append(rec)
    return out


def iter_events(
    source: Source,
    name: Names = None,
    *,
    rank: int | None = None,
    pattern: str = "*.jsonl",
    where: Callable[[dict[str, Any]], bool] | None = None,
) -> Iterator[dict[str, Any]]:
    """Events of a run directory (its logs/), a logs directory, or one .jsonl file, file by
    file in name order and in order within a file. `name`: one event name or several;
    `rank`: only rank<R>.jsonl; `pattern`: which files of a directory."""
    names = {name} if isinstance(name, str) else (set(name) if name is not None else None)
    for path in _files(source, rank, pattern):
        try:
            text = path.read_text(errors="replace")
        except OSError:  # not there (yet), or removed under us
            continue
        for e in parse_lines(text):
            if (names is None or e.get("event") in names) and (where is None or where(e)):
                yield e


def read_events(
    source: Source,
    name: Names = None,
    *,
    rank: int | None = None,
    pattern: str = "*.jsonl",
    where: Callable[[dict[str, Any]], bool] | None = None,
) -> list[dict[str, Any]]:
    """`iter_events` as a list."""
    return list(iter_events(source, name, rank=rank, pattern=pattern, where=where))


def latest_event(
    source: Source,
    name: Names,
    rank: int | None = None,
    where: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any] | None:
    """The last matching event (in file order), or None."""
    found = None
    for e in iter_events(source, name, rank=rank, where=where):
        found = e
    return found


def timestamp(e: dict[str, Any]) -> float:
    """An event's `ts` (ISO 8601, UTC) as epoch seconds. KeyError/ValueError if it has none."""
    return datetime.fromisoformat(str(e["ts"]).replace("Z", "+00:00")).timestamp()


class EventTail:
    """Reads files of a logs directory incrementally: each call returns what was appended
    since the last one (a line still being written is read next time)."""

    def __init__(self, logs_dir: Source, pattern: str = "rank*.jsonl") -> None:
        self.dir = Path(logs_dir)
        self.pattern = pattern
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.dir.is_dir():
            return new
        for path in sorted(self.dir.glob(self.pattern)):
            start = self._offsets.get(path, 0)
            try:
                with path.open("rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            new += parse_lines(data[:end])
            self._offsets[path] = start + end
        return new
