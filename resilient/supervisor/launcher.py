"""`resilient run`: torch elastic's agent with restart supervision, preemption and a report.

The flow: parse and check the command line (config.py), build torch's LaunchConfig with
torch's own `config_from_args`, then run one SupervisedAgent (agent.py) the way
`torch.distributed.launcher.api.launch_agent` does: rendezvous handler from the registry,
WorkerSpec, agent.run(), rendezvous shut down unless a signal stopped us. The Supervisor below
answers the agent's questions (restart? after how long? stop with which code?) and keeps the
run's record in <run_dir>/supervisor_report.json and <run_dir>/logs/supervisor.jsonl.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args

from resilient.errors import ResilientError
from resilient.log import EventLog, open_event_log
from resilient.runtime.exitcodes import ExitCode
from resilient.runtime.preempt import ENV_GRACE_S, ENV_PREEMPT_SIGNALS
from resilient.runtime.runtime import ENV_CHECKPOINT_DIR, ENV_RUN_DIR
from resilient.supervisor.agent import FailureInfo, SupervisedAgent, Verdict
from resilient.supervisor.config import SupervisorConfig, UsageError, parse_command_line
from resilient.supervisor.policy import RestartTracker
from resilient.supervisor.report import (
    AttemptRecord,
    CheckpointProbe,
    EventLogs,
    RunReport,
    explain_failures,
    repeating_failure,
)

__all__ = ["Supervisor", "main"]


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
        self.report = RunReport(
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

    def on_event(self, event: str, **fields: Any) -> None:
        self.log.info(event, **fields)
        att = self.current
        if event == "restart.membership" and att is not None and att.outcome == "running":
            att.outcome, att.action, att.ended_at = "stopped", "membership change", time.time()

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


def _launch(
    config: LaunchConfig, entrypoint: Any, args: list[str], sup: Supervisor
) -> tuple[RunResult | None, int | None]:
    """launch_agent's steps with a SupervisedAgent; returns (result, the agent's stop code)."""
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr = master_port = None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = SupervisedAgent(
        spec,
        hooks=sup,
        grace_s=sup.cfg.grace_s,
        stop_signal=sup.cfg.signals()[0] if sup.cfg.signals() else signal.SIGTERM,
        preempt_signals=sup.cfg.signals(),
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=int(config.shutdown_timeout or 30),
    )
    shutdown_rdzv = True
    try:
        return agent.run(), agent.stop_code
    except SignalException:
        shutdown_rdzv = False  # as torch: a signalled agent leaves the rendezvous open
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def _early_signal(signum: int, frame: FrameType | None) -> None:
    # before the agent installs its own handlers: the same exception torch's handler raises
    raise SignalException(f"Process {os.getpid()} got signal {signum}", signal.Signals(signum))


def main(argv: list[str]) -> int:
    """`resilient run ARGS`; returns the exit code (see resilient.runtime.exitcodes)."""
    try:
        cfg, args = parse_command_line(argv)
        config, entrypoint, cmd_args = config_from_args(args)
        config.shutdown_timeout = args.shutdown_timeout
    except (UsageError, ResilientError, ValueError, AssertionError) as e:
        print(f"resilient run: error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    if cfg.checkpoint_url is not None:
        from resilient.storage import Storage

        try:
            Storage(cfg.checkpoint_url).check_writable()
        except (OSError, ResilientError) as e:
            print(f"resilient run: error: checkpoint location: {e}", file=sys.stderr)
            return int(ExitCode.USAGE)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if config.max_nodes > 1:
        # torch 2.13's dynamic rendezvous shares the rank-0 agent's TCPStore with the workers
        # but publishes its address only in the round it was created: a node joining a later
        # round waits for MASTER_ADDR forever (seen in tests/test_elastic.py). Unshared, each
        # round publishes a fresh address and worker rank 0 hosts the store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[ENV_RUN_DIR] = cfg.run_dir
    if cfg.checkpoint_url is not None:
        os.environ[ENV_CHECKPOINT_DIR] = cfg.checkpoint_url
    os.environ[ENV_GRACE_S] = repr(cfg.grace_s)
    os.environ[ENV_PREEMPT_SIGNALS] = ",".join(cfg.preempt_signals)
    sup = Supervisor(
        cfg,
        run_id=config.run_id,
        command=["resilient", "run", *argv],
        multi_node=config.max_nodes > 1,
    )
    longest = sup.logs.longest_save_s()
    if longest is not None and longest > 0.9 * cfg.grace_s:
        msg = (
            f"the longest recent save in {cfg.run_dir} took {longest:.1f} s, close to or over "
            f"--grace-period {cfg.grace_s:g} s: a preemption may not fit a final save (the "
            "previous checkpoint stays valid). Raise --grace-period or save more often"
        )
        sup.log.warning("preempt.grace_too_short", longest_save_s=longest, grace_s=cfg.grace_s)
        sup.report.notes.append(msg)
        print(f"resilient run: warning: {msg}", file=sys.stderr)
    sup.log.info(
        "supervisor.start",
        nnodes=f"{config.min_nodes}:{config.max_nodes}",
        nproc_per_node=config.nproc_per_node,
        rdzv=f"{config.rdzv_backend}:{config.rdzv_endpoint}",
        max_restarts=config.max_restarts,
        grace_s=cfg.grace_s,
        checkpoint_url=cfg.checkpoint_url,
        run_dir=cfg.run_dir,
    )
    for sig in cfg.signals():
        signal.signal(sig, _early_signal)
    code, outcome, reason = _supervise(sup, config, entrypoint, cmd_args)
    last = sup.current
    if last is not None and last.outcome == "running":
        last.outcome, last.ended_at = outcome, time.time()
    sup.report.finish(code, outcome, reason or sup.report.reason)
    sup.report.write()
    sup.log.info("supervisor.exit", exit_code=code, outcome=outcome, reason=sup.report.reason)
    print(sup.report.summary(), file=sys.stderr)
    sup.log.close()
    return code


def _supervise(
    sup: Supervisor, config: LaunchConfig, entrypoint: Any, cmd_args: list[str]
) -> tuple[int, str, str | None]:
    try:
        result, stop_code = _launch(config, entrypoint, cmd_args, sup)
    except SignalException as e:
        if e.sigval in sup.cfg.signals():
            return int(ExitCode.PREEMPTED), "preempted", sup.preemption_note()
        return 128 + int(e.sigval), "interrupted", f"launcher got {e.sigval.name}"
    except (RendezvousError, DistError) as e:  # DistError: the rendezvous store failed
        return 1, "rendezvous failed", f"{type(e).__name__}: {str(e)[:500]}"
    if result is None:  # the rendezvous was closed by another node: the job is over
        return 0, "finished elsewhere", "the rendezvous was closed by another node"
    if not result.is_failed():
        return 0, "succeeded", None
    if stop_code == ExitCode.PREEMPTED:
        return int(ExitCode.PREEMPTED), "preempted", sup.preemption_note()
    if stop_code == ExitCode.CRASH_LOOP:
        return int(stop_code), "crash loop", None
    if stop_code is not None:
        return int(stop_code), "failed", None
    return int(ExitCode.RESTARTS_EXHAUSTED), "failed", "restarts exhausted"
