"""The command line of `resilient run`: torchrun's own parser plus resilient's flags.

`resilient run [torchrun flags] [resilient flags] script.py [script args]`. torchrun's flags
keep their meaning, with three defaults changed: the rendezvous is c10d (torchrun: static,
unless single-node), --max-restarts is 10 (torchrun: 0; crash-loop detection stops a hopeless
run first), and --shutdown-timeout follows --grace-period. Everything is checked before a
process starts: an unknown flag, a missing script, an impossible value exit with
ExitCode.USAGE and a message saying what to change.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import signal
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, NoReturn

from resilient.envvars import (
    DEFAULT_GRACE_S,
    DEFAULT_SIGNALS,
    ENV_CHECKPOINT_DIR,
    ENV_RUN_DIR,
    parse_signals,
)
from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.supervisor._torch_compat import get_args_parser, parse_min_max_nnodes
from resilient.supervisor.batchplan import add_batch_flags
from resilient.supervisor.opsflags import OpsConfig, add_ops_flags, ops_config
from resilient.supervisor.policy import RestartPolicy

__all__ = ["DEFAULT_MAX_RESTARTS", "SupervisorConfig", "UsageError", "parse_command_line"]

DEFAULT_MAX_RESTARTS = 10
_RESILIENT_FLAGS = "resilient"


class UsageError(ConfigError):
    """The command line cannot work; nothing was started."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.USAGE), f"{self.prog}: error: {message}\n")


@dataclass(kw_only=True, slots=True)
class SupervisorConfig:
    """resilient's own launcher options (torchrun's live in its LaunchConfig)."""

    run_dir: str
    """Event logs of every rank (<run_dir>/logs), the supervisor's log and its report."""
    checkpoint_url: str | None = None
    """Exported to the workers as RESILIENT_CHECKPOINT_DIR; also how the supervisor measures
    progress for crash-loop detection (else from the workers' logs)."""
    grace_s: float = DEFAULT_GRACE_S
    """From a preemption signal to SIGKILL: the workers agree, save, commit and leave in it."""
    preempt_signals: tuple[str, ...] = DEFAULT_SIGNALS
    """Signals that mean "save and leave" to the launcher and to every worker."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """Backoff between restarts and the crash-loop limit."""
    hot_max: int = 0
    """Hot recoveries of a lost worker per attempt (`--hot-recovery`); 0: off, every failure
    restarts the group (resilient/hot/recovery.py)."""
    ops: OpsConfig = field(default_factory=OpsConfig)
    """Health checks, live metrics, the status line, straggler eviction (opsflags.py)."""
    rdzv_external: bool = False
    """No training node hosts the rendezvous store (`--rdzv-external`, or the etcd-v2
    backend): every node is its client (supervisor/rdzv.py)."""
    rdzv_wait_s: float = 30.0
    start_timeout_s: float | None = None
    """Every local rank reaches its first training step within this long of its attempt's
    start, or the attempt is named and restarted (`--start-timeout`; None: no bound here)."""
    """How long an external store may take to answer at start before the run stops."""

    def __post_init__(self) -> None:
        if not self.grace_s > 0:
            raise UsageError(f"--grace-period must be > 0 seconds, got {self.grace_s}")
        parse_signals(",".join(self.preempt_signals))  # raises on a bad name

    def signals(self) -> tuple[signal.Signals, ...]:
        return parse_signals(",".join(self.preempt_signals))


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser (same flags, same PET_* environment defaults) plus resilient's."""
    base = get_args_parser()
    parser = _Parser(
        prog="resilient run",
        description="Run a training script under torch elastic with resilient's restart "
        "supervision, preemption handling and elastic resume. torchrun's flags work unchanged.",
        parents=[base],
        add_help=False,
        conflict_handler="resolve",
    )
    if "PET_MAX_RESTARTS" not in os.environ:
        parser.set_defaults(max_restarts=DEFAULT_MAX_RESTARTS)
    if "PET_RDZV_BACKEND" not in os.environ:
        parser.set_defaults(rdzv_backend=None)  # None: not given, c10d chosen below
    g = parser.add_argument_group("resilient")
    g.add_argument(
        "--run-dir",
        default=os.environ.get(ENV_RUN_DIR),
        help="run directory: per-rank event logs, supervisor log and report "
        "(default $RESILIENT_RUN_DIR, else runs/<rdzv id>)",
    )
    g.add_argument(
        "--checkpoint-url",
        "--ckpt-url",
        default=os.environ.get(ENV_CHECKPOINT_DIR),
        help="checkpoint directory or fsspec URL, exported to workers as "
        "RESILIENT_CHECKPOINT_DIR (default: $RESILIENT_CHECKPOINT_DIR)",
    )
    g.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="preemption budget: from SIGTERM to SIGKILL, workers agree on a step, save, "
        f"commit and exit {int(ExitCode.PREEMPTED)} (default {DEFAULT_GRACE_S:g}, Kubernetes' "
        "terminationGracePeriodSeconds)",
    )
    g.add_argument(
        "--preempt-signals",
        default=",".join(DEFAULT_SIGNALS),
        help="comma-separated signals that mean 'save and leave' (default SIGTERM,SIGUSR1)",
    )
    g.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="first wait after a failure without checkpoint progress; doubles each time",
    )
    g.add_argument("--restart-backoff-max", type=float, default=60.0, metavar="SECONDS")
    g.add_argument("--restart-jitter", type=float, default=1.0, metavar="SECONDS")
    g.add_argument(
        "--crash-loop-restarts",
        type=int,
        default=3,
        metavar="K",
        help=f"stop with exit code {int(ExitCode.CRASH_LOOP)} after K consecutive restarts "
        "without checkpoint progress (default 3)",
    )
    g.add_argument(
        "--hot-recovery",
        action="store_true",
        help="when one worker dies, keep the others running: they re-form with a replacement "
        "and continue from their in-memory snapshots, without a restart (Python scripts)",
    )
    g.add_argument(
        "--hot-max",
        type=int,
        default=3,
        metavar="N",
        help="hot recoveries per attempt before a failure restarts the group (default 3)",
    )
    g.add_argument(
        "--rdzv-external",
        action="store_true",
        help="the --rdzv-endpoint store runs apart from the training nodes (`resilient "
        "rendezvous`): every node connects to it as a client, and any node may leave, the "
        "first one too (implied by --rdzv-backend etcd-v2)",
    )
    g.add_argument(
        "--rdzv-wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with an external store: how long it may take to answer at start (default 30)",
    )
    g.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="every worker reaches its first training step (a train.progress event: a script "
        "under resilient.init() or an adapter) within SECONDS of its attempt's start, or the "
        "attempt is named and restarted; it covers what runs before the runtime's own "
        "watchdog, such as a framework's init_process_group (default: off)",
    )
    add_ops_flags(parser)
    add_batch_flags(parser)
    return parser


def parse_command_line(
    argv: list[str], *, warn: Any = None
) -> tuple[SupervisorConfig, argparse.Namespace]:
    """Parse and check `argv` (after `run`). Raises UsageError; argparse errors exit USAGE.

    Returns resilient's config and torchrun's namespace, completed (rendezvous chosen,
    signals, shutdown timeout) so torch's config_from_args can build the LaunchConfig.
    """
    warn = warn or (lambda msg: print(f"resilient run: warning: {msg}", file=sys.stderr))
    args = build_parser().parse_args(argv)
    try:
        policy = RestartPolicy(
            backoff_s=args.restart_backoff,
            backoff_max_s=args.restart_backoff_max,
            jitter_s=args.restart_jitter,
            crash_loop_restarts=args.crash_loop_restarts,
        )
        signals = tuple(s.name for s in parse_signals(args.preempt_signals))
        ops = ops_config(args)
    except ConfigError as e:
        raise UsageError(str(e)) from e
    _check_script(args)
    external = args.rdzv_external or args.rdzv_backend in ("etcd-v2",)
    if external and not args.rdzv_endpoint:
        raise UsageError("--rdzv-external needs --rdzv-endpoint HOST:PORT of the store")
    _choose_rendezvous(args, warn)
    if external and args.rdzv_backend not in ("c10d", "etcd-v2"):
        raise UsageError(
            f"--rdzv-external needs --rdzv-backend c10d or etcd-v2, not {args.rdzv_backend!r}"
        )
    if not args.rdzv_wait > 0:
        raise UsageError(f"--rdzv-wait must be > 0 seconds, got {args.rdzv_wait}")
    if args.start_timeout is not None and not args.start_timeout > 0:
        raise UsageError(f"--start-timeout must be > 0 seconds, got {args.start_timeout}")
    if args.hot_recovery and args.no_python:
        raise UsageError("--hot-recovery re-runs a Python script in place: not with --no-python")
    for flag in ("per_rank_batch", "global_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.hot_max < 1:
        raise UsageError(f"--hot-max must be >= 1, got {args.hot_max}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.monitor_interval <= 0:
        raise UsageError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    # the agent forwards these to the workers and waits --shutdown-timeout before SIGKILL
    handled = [s.strip() for s in args.signals_to_handle.split(",") if s.strip()]
    args.signals_to_handle = ",".join(handled + [s for s in signals if s not in handled])
    grace = math.ceil(args.grace_period)
    if args.shutdown_timeout is not None and args.shutdown_timeout < grace:
        warn(
            f"--shutdown-timeout {args.shutdown_timeout} is shorter than --grace-period "
            f"{args.grace_period:g}: using {grace} s so workers are not killed mid-save"
        )
    args.shutdown_timeout = max(grace, args.shutdown_timeout or 0)
    run_dir = args.run_dir or os.path.join("runs", args.rdzv_id)
    cfg = SupervisorConfig(
        run_dir=os.path.abspath(run_dir),
        checkpoint_url=args.checkpoint_url,
        grace_s=args.grace_period,
        preempt_signals=signals,
        restart=policy,
        hot_max=args.hot_max if args.hot_recovery else 0,
        ops=ops,
        rdzv_external=external,
        rdzv_wait_s=args.rdzv_wait,
        start_timeout_s=args.start_timeout,
    )
    return cfg, args


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"module {script!r} (-m) cannot be found on sys.path")
    elif args.no_python:
        if shutil.which(script) is None:
            raise UsageError(f"--no-python: {script!r} is not an executable on PATH")
    elif args.run_path and not os.path.isabs(script):
        raise UsageError(f"--run-path needs an absolute script path, got {script!r}")
    elif not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist (cwd {os.getcwd()})")


def _choose_rendezvous(args: argparse.Namespace, warn: Any) -> None:
    """torchrun's choices, except that c10d is the default backend (see module doc)."""
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"--nnodes {args.nnodes!r}: {e}; use N or MIN:MAX") from e
    if not 0 < min_nodes <= max_nodes:
        raise UsageError(f"--nnodes {args.nnodes!r}: need 0 < MIN <= MAX")
    single = max_nodes == 1
    if args.standalone or (
        args.rdzv_backend is None and single and not args.rdzv_endpoint and args.master_port is None
    ):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend is None:
        args.rdzv_backend = "c10d"
        if not args.rdzv_endpoint:
            if args.master_port is None:
                raise UsageError(
                    f"--nnodes {args.nnodes} spans several nodes: give --rdzv-endpoint HOST:PORT "
                    "of a host every node can reach (the first node there hosts the rendezvous)"
                )
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"
        if args.rdzv_id == "none" and not single:
            warn("--rdzv-id not given: every job on this endpoint shares the id 'none'")
    if args.rdzv_id == "none" and single:
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500  # as torchrun: only the static rendezvous reads it
