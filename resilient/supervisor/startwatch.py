"""The bound on an attempt's start (`resilient run --start-timeout`): every local worker
reaches its first training step within that long of the attempt's start, or the attempt is
named and restarted.

The runtime's watchdog bounds what runs after `resilient.init()` (its startup timeout). What
runs before it is unwatched: a framework's own `init_process_group` (Accelerate's in
TrainingArguments, Lightning's in its strategy), imports, a dataset's download. A start
stuck there waited for torch's process-group timeout (30 minutes by default), and nothing
named it. The agent cannot see inside a worker, but it can read the workers' event logs: a
rank that logged no `train.progress` in this attempt by the deadline has not reached its
first step. It is named with the last event it logged (none: still before the runtime),
killed, and the attempt takes the restart path.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StartWatch", "not_started"]


def not_started(
    records: list[dict[str, Any]], restart: int, ranks: list[int]
) -> dict[int, str | None]:
    """Of `ranks`, those that logged no train.progress in attempt `restart`, each with the
    name of the last event it logged in that attempt (None: none at all)."""
    last: dict[int, str | None] = dict.fromkeys(ranks)
    stepped: set[int] = set()
    for r in records:
        rank = r.get("rank")
        if rank not in last or r.get("restart") != restart:
            continue
        last[rank] = str(r.get("event"))
        if r.get("event") == "train.progress":
            stepped.add(rank)
    return {rank: ev for rank, ev in last.items() if rank not in stepped}


class StartWatch:
    """One attempt's deadline; `due()` is true once, when it has passed."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._by: float | None = None

    def started(self) -> None:
        """The attempt's workers were just started."""
        self._by = None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def due(self) -> bool:
        if self._by is None or time.monotonic() < self._by:
            return False
        self._by = None
        return True
