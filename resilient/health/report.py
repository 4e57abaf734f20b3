"""What the node checks take and what they give back: HealthInputs, CheckResult, HealthReport.

A CheckResult is one line of evidence: the value measured, the threshold it was held to, and
(when it failed) one sentence saying what to fix. A skipped check (nothing to check on this
node: no GPU, no checkpoint location, no command) passes and says why it was skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CheckResult",
    "HealthInputs",
    "HealthReport",
    "failed_check",
    "fmt_bytes",
    "ok_check",
    "skipped_check",
]

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True, slots=True)
class HealthInputs:
    """What the supervisor knows about the run when it checks its node."""

    run_dir: str
    """<run_dir>/logs/rank*.jsonl hold the previous attempts' worker events."""
    checkpoint_url: str | None
    """A local directory or an fsspec URL (s3://...); None when the run has none."""
    nproc_per_node: int
    """Workers this node starts: the shared memory and snapshot needs scale with it."""
    user_cmd: tuple[str, ...] = ()
    """--health-check CMD, already split; () for none."""
    user_timeout_s: float = 10.0
    """--health-check-timeout: a command that runs longer fails."""
    builtin: bool = True
    """Run the built-in checks; False (--no-health-check) runs only the user's command."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    """checkpoint_reachable, checkpoint_space, shm, host_memory, gpu or user_command."""
    ok: bool
    skipped: bool
    """Nothing to check here (no GPU, no checkpoint location, ...): ok is True."""
    value: str
    """What was measured, readable ("3.1 GiB free")."""
    threshold: str
    """What it had to be, and where that number comes from."""
    detail: str
    """What to fix, one sentence, when it failed (else a note or "")."""
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "skipped": self.skipped,
            "value": self.value,
            "threshold": self.threshold,
            "detail": self.detail,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True, slots=True)
class HealthReport:
    """Every check of one round, in a fixed order, and the time they took together."""

    checks: tuple[CheckResult, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def summary(self) -> str:
        """One line per failed check: its name, what was measured, what it needed and what
        to fix ("" when every check passed)."""
        return "\n".join(
            f"{c.name}: {c.value} (needs {c.threshold}); {c.detail}" for c in self.failed
        )

    def to_json(self) -> dict[str, Any]:
        """For the supervisor's report and the metrics exporter."""
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 4),
            "failed": [c.name for c in self.failed],
            "checks": [c.to_json() for c in self.checks],
        }


def fmt_bytes(n: float) -> str:
    """1.5 GiB, 300.0 MiB, 12.0 KiB, 17 B."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def ok_check(name: str, t0: float, value: str, threshold: str, note: str = "") -> CheckResult:
    """A check that passed; `t0` is its time.perf_counter() start."""
    return CheckResult(name, True, False, value, threshold, note, time.perf_counter() - t0)


def failed_check(name: str, t0: float, value: str, threshold: str, fix: str) -> CheckResult:
    return CheckResult(name, False, False, value, threshold, fix, time.perf_counter() - t0)


def skipped_check(
    name: str, t0: float, why: str, threshold: str = "nothing to check"
) -> CheckResult:
    return CheckResult(name, True, True, why, threshold, "", time.perf_counter() - t0)
