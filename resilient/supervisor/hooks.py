"""The supervisor's side of `resilient run`: answers to the agent's questions and the record.

`Supervisor` is the agent's hooks (resilient/supervisor/agent.py): it records each attempt,
explains failures from the workers' event logs, decides between restarting (after a backoff)
and stopping (crash loop, preemption, a numerical fault, restarts exhausted), and keeps the
run's record in <run_dir>/supervisor_report.json and <run_dir>/logs/supervisor.jsonl
(`_supervisor_log`).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from resilient.exitcodes import ExitCode
from resilient.log import EventLog, open_event_log
from resilient.supervisor.agent import FailureInfo, Verdict
from resilient.supervisor.config import SupervisorConfig
from resilient.supervisor.policy import RestartTracker
from resilient.supervisor.report import (
    AttemptRecord,
    CheckpointProbe,
    EventLogs,
    RankFailure,
    SupervisorReport,
    explain_failures,
    repeating_failure,
)
from resilient.supervisor.startwatch import not_started

__all__ = ["Supervisor"]


def _supervisor_log(run_dir: str, run_id: str, *, name: str = "supervisor.jsonl") -> EventLog:
    """JSON lines in <run_dir>/logs/supervisor.jsonl and readable lines on stderr (the
    runtime's pipeline, resilient.log)."""
    static = {"source": "supervisor", "run_id": run_id, "host": socket.gethostname()}
    return open_event_log(Path(run_dir) / "logs" / name, static={**static, "pid": os.getpid()})


class Supervisor:
    """The agent's hooks: records attempts, decides restarts, writes the report."""

    def __init__(
        self, cfg: SupervisorConfig, *, run_id: str, command: list[str], multi_node: bool = False
    ) -> None:
        self.cfg = cfg
        self.logs = EventLogs(cfg.run_dir)
        self.logs.refresh()  # earlier runs in this directory: progress baseline, save times
        # one file per host where several nodes may share the run directory
        suffix = f"_{socket.gethostname()}" if multi_node else ""
        self.log = _supervisor_log(cfg.run_dir, run_id, name=f"supervisor{suffix}.jsonl")
        self.probe = CheckpointProbe(cfg.checkpoint_url, self.logs)
        self.tracker = RestartTracker(cfg.restart, self.probe)
        self.report = SupervisorReport(
            run_id=run_id,
            run_dir=cfg.run_dir,
            command=command,
            filename=f"supervisor_report{suffix}.json",
        )

    @property
    def current(self) -> AttemptRecord | None:
        return self.report.attempts[-1] if self.report.attempts else None

    def on_start(
        self, *, restart: int, attempt_id: str, world_size: int, group_rank: int, pids: list[int]
    ) -> None:
        self.report.attempts.append(
            AttemptRecord(
                restart=restart,
                attempt_id=attempt_id,
                started_at=time.time(),
                world_size=world_size,
                group_rank=group_rank,
            )
        )
        self.log.info(
            "attempt.start",
            restart=restart,
            attempt=attempt_id,
            world_size=world_size,
            node=group_rank,
            pids=pids,
        )

    def note_health(self, report: Any) -> None:
        """A round's node checks (resilient.health.HealthReport), for the report."""
        self.report.health.append(report.to_json())
        if not report.ok:
            self.report.write()

    def on_event(self, event: str, **fields: Any) -> None:
        self.log.info(event, **fields)
        att = self.current
        if event == "restart.membership" and att is not None and att.outcome == "running":
            att.outcome, att.action, att.ended_at = "stopped", "membership change", time.time()

    def not_started(self, restart: int, ranks: list[int]) -> dict[int, str | None]:
        """Of this node's global `ranks`, those with no first step in attempt `restart`
        (supervisor/startwatch.py), each with the last event it logged."""
        self.logs.refresh()
        return not_started(self.logs.records, restart, ranks)

    def on_failure(
        self, *, restart: int, failures: list[FailureInfo], restarts_left: int, nodes_waiting: int
    ) -> Verdict:
        att = self.current
        detected = time.time()
        records = explain_failures(
            (
                (f.rank, f.local_rank, f.pid, f.exit_code, f.error_file_message, f.root)
                for f in failures
            ),
            self.logs,
        )
        roots = [r for r in records if r.root] or records
        if att is not None:
            att.ended_at, att.failures = detected, records
        preempted = bool(roots) and all(r.exit_code == ExitCode.PREEMPTED for r in roots)
        if preempted:
            self.log.info("worker.preempted", ranks=[r.rank for r in roots])
        for r in [] if preempted else roots:
            self.log.warning(
                "worker.failed",
                rank=r.rank,
                exit_code=r.exit_code,
                step=r.step,
                error=r.error,
                meaning=r.meaning,
                cause_from=r.source,
            )
        if preempted:
            if nodes_waiting > 0:  # another agent stopped the group to admit a node
                return self._decided(att, "membership change", "rejoin", Verdict("rejoin"))
            return self._decided(
                att, "preempted", "stop", Verdict("stop", code=int(ExitCode.PREEMPTED))
            )
        numeric = [r for r in roots if r.exit_code == ExitCode.NUMERICAL_FAULT]
        if numeric:
            return self._numerical_fault(att, numeric)
        mismatch = [r for r in roots if r.exit_code == ExitCode.MISMATCH]
        if mismatch:
            return self._mismatch(att, mismatch)
        d = self.tracker.on_failure(restarts_left=restarts_left)
        if att is not None:
            att.progress = d.progress
        if self.tracker.crash_loop:
            k = self.cfg.restart.crash_loop_restarts
            self.report.repeating = repeating_failure(self.report.attempts[-(k + 1) :])
            rep = self.report.repeating or {}
            self.log.error(
                "restart.crash_loop",
                restarts_without_progress=k,
                newest_checkpoint=d.progress,
                repeating=rep,
            )
            reason = (
                f"{k} consecutive restarts made no checkpoint progress (newest committed step "
                f"{d.progress}); repeating failure: rank {rep.get('rank')} at step "
                f"{rep.get('step')}: {rep.get('error')} ({rep.get('attempts')} of "
                f"{rep.get('of')} attempts)"
            )
            self.report.reason = reason
            return self._decided(
                att, "failed", "stop: crash loop", Verdict("stop", code=int(ExitCode.CRASH_LOOP))
            )
        if not d.restart:
            return self._decided(
                att,
                "failed",
                "stop: restarts exhausted",
                Verdict("stop", code=int(ExitCode.RESTARTS_EXHAUSTED)),
            )
        self.log.info(
            "restart.decided",
            restart=restart + 1,
            delay_s=round(d.delay_s, 3),
            streak=d.streak,
            newest_checkpoint=d.progress,
            restarts_left=restarts_left - 1,
        )
        if att is not None:
            att.delay_s = d.delay_s
        return self._decided(att, "failed", "restart", Verdict("restart", delay_s=d.delay_s))

    def _numerical_fault(self, att: AttemptRecord | None, roots: list[RankFailure]) -> Verdict:
        """Stop with NUMERICAL_FAULT: a restart would resume from the same checkpoint with
        the same data and meet the same non-finite value again."""
        first = roots[0]
        where = f" at step {first.step}" if first.step is not None else ""
        return self._stop(
            att,
            roots,
            ExitCode.NUMERICAL_FAULT,
            f"rank {first.rank} exited NUMERICAL_FAULT ({int(ExitCode.NUMERICAL_FAULT)}){where}: "
            "a non-finite loss, gradient or checkpoint value that a restart from the same "
            "checkpoint would meet again; not restarted. Fix the data or the model; every "
            "good checkpoint is kept",
            event="restart.numerical_fault",
            label="stop: numerical fault",
        )

    def _mismatch(self, att: AttemptRecord | None, roots: list[RankFailure]) -> Verdict:
        """Stop with MISMATCH: the checkpoint or the configuration does not fit the script,
        and a restart would load the same checkpoint into the same script again."""
        first = roots[0]
        return self._stop(
            att,
            roots,
            ExitCode.MISMATCH,
            f"rank {first.rank} exited MISMATCH ({int(ExitCode.MISMATCH)}): {first.error}; "
            "a restart would meet it again, so it was not restarted. Fix the script or the "
            "checkpoint location",
            event="restart.mismatch",
            label="stop: mismatch",
        )

    def _stop(
        self,
        att: AttemptRecord | None,
        roots: list[RankFailure],
        code: ExitCode,
        reason: str,
        *,
        event: str,
        label: str,
    ) -> Verdict:
        """Stop with `code` for a failure a restart would meet again, said in `event`."""
        first = roots[0]
        self.report.reason = reason
        self.log.error(
            event,
            ranks=[r.rank for r in roots],
            step=first.step,
            error=first.error,
            action="stop",
            reason=reason,
        )
        return self._decided(att, "failed", label, Verdict("stop", code=int(code)))

    def _decided(
        self, att: AttemptRecord | None, outcome: str, action: str, verdict: Verdict
    ) -> Verdict:
        if att is not None:
            att.outcome, att.action = outcome, action
        self.report.write()
        return verdict

    def preemption_note(self) -> str:
        """What the workers' logs say about the last coordinated stop."""
        self.logs.refresh()
        done = self.logs.named("preempt.exit", "preempt.skip_save", "preempt.stop")
        if not done:
            return "no coordinated stop logged; the newest valid checkpoint is where it resumes"
        last = done[-1]
        skipped = self.logs.named("preempt.skip_save")
        if last["event"] == "preempt.exit" and last.get("committed") == last.get("step"):
            return (
                f"stopped at step {last.get('step')} with its checkpoint committed, "
                f"{last.get('since_signal_s')} s after the signal"
            )
        if skipped:
            sk = skipped[-1]
            return (
                f"stopped at step {sk.get('step')} without saving (estimate "
                f"{sk.get('estimate_s')} s > {sk.get('remaining_s')} s left); newest valid "
                f"checkpoint: step {sk.get('newest_valid')}"
            )
        return (
            f"stop agreed at step {last.get('step')}; newest committed checkpoint: step "
            f"{last.get('committed')}"
        )
