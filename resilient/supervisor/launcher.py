"""`resilient run`: torch elastic's agent with restart supervision, preemption and a report.

The flow: parse and check the command line (config.py), build torch's LaunchConfig with
torch's own `config_from_args`, then run one SupervisedAgent (agent.py) the way
`torch.distributed.launcher.api.launch_agent` does: rendezvous handler from the registry,
WorkerSpec, agent.run(), rendezvous shut down unless a signal stopped us. The Supervisor
(hooks.py) answers the agent's questions (restart? after how long? stop with which code?) and
keeps the run's record in <run_dir>/supervisor_report.json and <run_dir>/logs/supervisor.jsonl.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from resilient.envvars import (
    ENV_BATCH_POLICY,
    ENV_CHECKPOINT_DIR,
    ENV_GRACE_S,
    ENV_HOT,
    ENV_PREEMPT_SIGNALS,
    ENV_RUN_DIR,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
    TORCHELASTIC_SIGNALS_TO_HANDLE,
)
from resilient.errors import ResilientError
from resilient.exitcodes import ExitCode
from resilient.supervisor._torch_compat import config_from_args
from resilient.supervisor.agent import SupervisedAgent
from resilient.supervisor.batchplan import plan
from resilient.supervisor.config import UsageError, parse_command_line
from resilient.supervisor.gate import NodeGate, NodeLeaves
from resilient.supervisor.hooks import Supervisor
from resilient.supervisor.rdzv import (
    RendezvousStoreError,
    StoreOutliving,
    check_external,
    job_fingerprint,
)

__all__ = ["main"]


def _launch(
    config: LaunchConfig, entrypoint: Any, args: list[str], sup: Supervisor, gate: NodeGate
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
    os.environ[TORCHELASTIC_SIGNALS_TO_HANDLE] = config.signals_to_handle
    handler = rdzv_registry.get_rendezvous_handler(rdzv_parameters)
    if sup.cfg.rdzv_external:
        # torch's handler, rebuilt when the store restarts (rdzv.py)
        handler = StoreOutliving(
            lambda: rdzv_registry.get_rendezvous_handler(rdzv_parameters),
            first=handler,
            log=sup.log,
            endpoint=config.rdzv_endpoint,
            join_timeout_s=float(config.rdzv_configs.get("join_timeout", 600)),
        )
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
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
        hot_max=sup.cfg.hot_max,
        gate=gate,
        start_timeout_s=sup.cfg.start_timeout_s,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=int(config.shutdown_timeout or 30),
    )
    shutdown_rdzv = True
    try:
        gate.check()  # before the first round, as before every later one (agent.py)
        return agent.run(), agent.stop_code
    except NodeLeaves:
        shutdown_rdzv = False  # the others' rendezvous goes on without this node
        raise
    except SignalException:
        shutdown_rdzv = False  # as torch: a signalled agent leaves the rendezvous open
        raise
    except (RendezvousError, DistError):
        if agent.stop_code != ExitCode.PREEMPTED:  # not a stop whose store host left first
            raise
        shutdown_rdzv = False  # its store is gone with the node that hosted it
        return RunResult(state=WorkerState.FAILED), agent.stop_code
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def _node_trouble(exc: BaseException) -> bool:
    """Whether a failed probe of the checkpoint location is the node's state (a full disk, a
    store this node cannot reach right now) rather than a wrong location or credentials."""
    from resilient.storage.classify import is_retryable

    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if is_retryable(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _early_signal(signum: int, frame: FrameType | None) -> None:
    # before the agent installs its own handlers: the same exception torch's handler raises
    raise SignalException(f"Process {os.getpid()} got signal {signum}", signal.Signals(signum))


def main(argv: list[str], *, live: Callable[..., Any] | None = None) -> int:
    """`resilient run ARGS`; returns the exit code (see resilient.exitcodes).

    `live(run_dir, ops, log=...)` makes the live metrics and status line (the cli hands in
    resilient.live's LiveMonitor: the supervisor does not import the report's analysis)."""
    try:
        cfg, args = parse_command_line(argv)
        config, entrypoint, cmd_args = config_from_args(args)
        config.shutdown_timeout = args.shutdown_timeout
        if cfg.hot_max:
            # the script runs under the worker wrapper, which re-runs it after a hot recovery
            cmd_args = ["-u", "-m", "resilient.worker", *[a for a in cmd_args if a != "-u"]]
    except (UsageError, ResilientError, ValueError, AssertionError) as e:
        print(f"resilient run: error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    if cfg.checkpoint_url is not None:
        from resilient.storage import Storage

        try:
            Storage(cfg.checkpoint_url).check_writable()
        except (OSError, ResilientError) as e:
            # a full disk or an unreachable store is this node's health, which the health
            # check reports (exit NODE_EXCLUDED, measured values); anything else is the command
            if not (cfg.ops.health_checks and _node_trouble(e)):
                print(f"resilient run: error: checkpoint location: {e}", file=sys.stderr)
                return int(ExitCode.USAGE)
    external = None
    if cfg.rdzv_external:
        if config.rdzv_backend == "c10d":
            config.rdzv_configs["is_host"] = False  # no training node hosts it: all are clients
        try:
            external = check_external(
                config.rdzv_backend,
                config.rdzv_endpoint,
                run_id=config.run_id,
                fingerprint=job_fingerprint(
                    entrypoint=args.training_script,
                    args=list(args.training_script_args),
                    nproc_per_node=config.nproc_per_node,
                    nnodes=str(args.nnodes),
                    checkpoint=cfg.checkpoint_url,
                ),
                command=" ".join(["resilient", "run", *argv]),
                wait_s=cfg.rdzv_wait_s,
                protocol=str(config.rdzv_configs.get("protocol", "http")),
            )
        except RendezvousStoreError as e:
            print(f"resilient run: error: {e}", file=sys.stderr)
            return int(ExitCode.USAGE)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if config.max_nodes > 1:
        # torch 2.13's dynamic rendezvous shares the rank-0 agent's TCPStore with the workers
        # but publishes its address only in the round it was created: a node joining a later
        # round waits for MASTER_ADDR forever (docs/internals.md#g-rdzv-shared-store). Unshared,
        # each round publishes a fresh address, and the group-rank-0 agent hosts the workers'
        # store for the round (agent.py, _agree_round), where torch would have worker rank 0.
        os.environ.setdefault(TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1")
    os.environ[ENV_RUN_DIR] = cfg.run_dir
    if cfg.checkpoint_url is not None:
        os.environ[ENV_CHECKPOINT_DIR] = cfg.checkpoint_url
    os.environ[ENV_GRACE_S] = repr(cfg.grace_s)
    os.environ[ENV_PREEMPT_SIGNALS] = ",".join(cfg.preempt_signals)
    if cfg.hot_max:
        os.environ[ENV_HOT] = "1"
    if args.batch_policy:
        os.environ[ENV_BATCH_POLICY] = args.batch_policy
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
        rdzv_store="external" if cfg.rdzv_external else "this node or a peer",
    )
    if external is not None:
        sup.log.info("rdzv.external", **external)
    if config.max_nodes > config.min_nodes:  # said before the run: which node counts keep it
        lines, fields = plan(
            args, config.min_nodes, config.max_nodes, config.nproc_per_node, cfg.run_dir
        )
        sup.log.info("batch.plan", **fields)
        print("resilient run: " + "\n".join(lines), file=sys.stderr)
    monitor = None
    if live is not None and (cfg.ops.metrics_port is not None or cfg.ops.status != "off"):
        monitor = live(cfg.run_dir, cfg.ops, log=sup.log).start()
    try:
        for sig in cfg.signals():
            signal.signal(sig, _early_signal)
        code, outcome, reason = _supervise(sup, config, entrypoint, cmd_args)
    finally:
        if monitor is not None:
            monitor.close()  # its last status line, before the summary
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
    gate = NodeGate(
        sup.cfg,
        log=sup.log,
        logs=sup.logs,
        nproc_per_node=config.nproc_per_node,
        min_nodes=config.min_nodes,
        record=sup.note_health,
    )
    try:
        result, stop_code = _launch(config, entrypoint, cmd_args, sup, gate)
    except NodeLeaves as e:
        sup.report.notes.append(f"this node left the job ({e.reason}): {e.detail}")
        if e.reason == "health" and gate.last_health is not None:  # each check: summary()
            names = ", ".join(c.name for c in gate.last_health.failed)
            return int(ExitCode.NODE_EXCLUDED), "node excluded", f"failed health check: {names}"
        return int(ExitCode.NODE_EXCLUDED), "node excluded", f"{e.reason}: {e.detail}"
    except SignalException as e:
        if e.sigval in sup.cfg.signals():
            return int(ExitCode.PREEMPTED), "preempted", sup.preemption_note()
        return 128 + int(e.sigval), "interrupted", f"launcher got {e.sigval.name}"
    except (RendezvousError, DistError) as e:  # DistError: the rendezvous store failed
        why = f"{type(e).__name__}: {str(e)[:500]}"
        if isinstance(e, RendezvousTimeoutError):
            why += (
                f"; fewer than --nnodes MIN ({config.min_nodes}) nodes joined in time: a node "
                "that fails its health checks leaves (its report names them)"
            )
        return 1, "rendezvous failed", why
    if result is None:  # the rendezvous was closed by another node: the job is over
        return 0, "finished elsewhere", "the rendezvous was closed by another node"
    if not result.is_failed():
        return 0, "succeeded", None
    if stop_code == ExitCode.PREEMPTED:
        return int(ExitCode.PREEMPTED), "preempted", sup.preemption_note()
    if stop_code == ExitCode.CRASH_LOOP:
        return int(stop_code), "crash loop", None
    if stop_code == ExitCode.NUMERICAL_FAULT:
        return int(stop_code), "numerical fault", None
    if stop_code == ExitCode.MISMATCH:
        return int(stop_code), "mismatch", None
    if stop_code is not None:
        return int(stop_code), "failed", None
    return int(ExitCode.RESTARTS_EXHAUSTED), "failed", "restarts exhausted"
