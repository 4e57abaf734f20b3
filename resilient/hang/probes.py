"""Probes: checks that the watchdog's thread runs each tick, for a stall that its own rank can
name before any timeout falls due (a loader worker stuck in its fork: data/worker_start.py).

They run off the main thread, which may be the stuck one. A LocalStall a probe returns
becomes this rank's verdict at once (ExitCode.HANG); a probe that raises is dropped with a
warning, so a broken one never stops the heartbeats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilient.exitcodes import ExitCode

__all__ = ["LocalStall", "Probes"]


@dataclass(frozen=True)
class LocalStall:
    """What a probe found: this rank is stalled on something it can name itself."""

    reason: str
    timeout_kind: str
    """The rule that fired, as the report names a stall's timeout (e.g. "worker_start")."""
    timeout_s: float
    age_s: float
    """How long it has been stuck (the report dates the fault from it)."""
    detail: dict[str, Any] = field(default_factory=dict)

    def verdict(self, rank: int, *, dump: bool) -> dict[str, Any]:
        """`Verdicts.abort`'s arguments: a stall of `rank`, with its stacks when `dump`."""
        named = {
            "timeout_kind": self.timeout_kind,
            "timeout_s": self.timeout_s,
            "progress_age_s": round(self.age_s, 3),
            **self.detail,
        }
        return {
            "kind": "stalled",
            "code": ExitCode.HANG,
            "ranks": [rank],
            "reason": self.reason,
            "detail": named,
            "dump": [rank] if dump else [],
        }


Look = Callable[[], LocalStall | None]


class Probes:
    """The probes by name."""

    def __init__(self) -> None:
        self._looks: dict[str, Look] = {}

    def set(self, name: str, look: Look | None) -> None:
        """Add `look` under `name`, replacing the one there; None removes it."""
        if look is None:
            self._looks.pop(name, None)
        else:
            self._looks[name] = look

    def run(self, log: Any) -> LocalStall | None:
        """Each probe once; the first stall found."""
        for name, look in list(self._looks.items()):
            try:
                stall = look()
            except Exception as e:
                self._looks.pop(name, None)
                log.warning("watchdog.probe_error", probe=name, error=str(e)[:300])
                continue
            if stall is not None:
                return stall
        return None
