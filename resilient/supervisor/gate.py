"""Whether this node joins the next rendezvous round: its health checks, and (opt-in) whether
its ranks have stayed stragglers.

The agent asks before its first round and before every round after a restart. A node that
should not join leaves the job with ExitCode.NODE_EXCLUDED, without touching the rendezvous:
the others form the next round without it when --nnodes MIN:MAX allows, and its leaving is
not a failure, so it counts towards no node's crash-loop rule. Below MIN the job cannot form
a round; on a single node that is this node's exit, with the failed checks in its report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from resilient import events as ev
from resilient.health import HealthInputs, HealthReport, check_node
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.report import EventLogs

__all__ = ["NodeGate", "NodeLeaves"]


class NodeLeaves(Exception):
    """Raised inside the agent's loop: this node does not join the next round."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class _Round:
    nodes: int
    """Nodes of the last round (world size over local world size)."""
    since: float
    """When it started: straggler windows before it belong to an earlier world."""


class NodeGate:
    """The checks before each round (see module doc); `record` gets each HealthReport."""

    def __init__(
        self,
        cfg: SupervisorConfig,
        *,
        log: Any,
        logs: EventLogs,
        nproc_per_node: int,
        min_nodes: int,
        record: Any = None,
    ) -> None:
        self.cfg = cfg
        self._log = log
        self._logs = logs
        self._nproc = nproc_per_node
        self._min_nodes = min_nodes
        self._record = record
        self._round: _Round | None = None
        self.last_health: HealthReport | None = None

    def started(self, world_size: int) -> None:
        """A round started with `world_size` workers in all."""
        self._round = _Round(max(1, world_size // max(1, self._nproc)), time.time())

    def check(self) -> None:
        """Raise NodeLeaves when this node should not join the next round."""
        ops = self.cfg.ops
        if ops.health_checks or ops.health_check_cmd:
            report = check_node(
                HealthInputs(
                    run_dir=self.cfg.run_dir,
                    checkpoint_url=self.cfg.checkpoint_url,
                    nproc_per_node=self._nproc,
                    user_cmd=ops.health_check_cmd,
                    user_timeout_s=ops.health_check_timeout_s,
                    builtin=ops.health_checks,
                ),
                self._log,
            )
            self.last_health = report
            if self._record is not None:
                self._record(report)
            if not report.ok:
                self._leave("health", report.summary())
        if ops.evict_stragglers and self._round is not None:
            slow = self._straggling()
            if slow is not None:
                if self._round.nodes > self._min_nodes:
                    self._leave("straggler", slow)
                self._log.warning(
                    "straggler.kept",
                    detail=slow,
                    why=f"the last round had {self._round.nodes} node(s), --nnodes MIN is "
                    f"{self._min_nodes}: leaving would stop the job",
                )

    def _straggling(self) -> str | None:
        """A sentence naming this node's slow rank when each of the last K score windows of
        the last round put one of its ranks below the threshold; else None."""
        assert self._round is not None
        ops = self.cfg.ops
        self._logs.refresh()
        windows = [
            e
            for e in self._logs.named(ev.STRAGGLER_SCORES)
            if ev.timestamp(e) >= self._round.since and isinstance(e.get("scores"), dict)
        ][-ops.straggler_windows :]
        if len(windows) < ops.straggler_windows:
            return None
        worst: list[tuple[float, str]] = []
        for e in windows:
            mine = {str(r) for r in e.get("node_ranks") or []}
            scores = [(float(v), r) for r, v in e["scores"].items() if r in mine]
            if not scores or min(scores)[0] >= ops.straggler_threshold:
                return None
            worst.append(min(scores))
        ranks = sorted({r for _, r in worst}, key=int)
        return (
            f"rank(s) {', '.join(ranks)} of this node scored below {ops.straggler_threshold:g} "
            f"in the last {len(worst)} windows (scores {', '.join(f'{s:.2f}' for s, _ in worst)}: "
            "the median rank's pace over theirs)"
        )

    def _leave(self, reason: str, detail: str) -> None:
        self._log.warning(ev.NODE_EXCLUDED, reason=reason, detail=detail)
        raise NodeLeaves(reason, detail)
