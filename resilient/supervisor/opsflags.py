"""`resilient run`'s operability flags: health checks, live metrics, the status line and
straggler eviction (docs/operating.md, "Operating a run").

Each is checked before anything starts: a port already in use, a health-check command that
is not on PATH, a threshold out of range exit with ExitCode.USAGE and say what to change.
"""

from __future__ import annotations

import argparse
import errno
import shlex
import shutil
import socket
from dataclasses import dataclass

from resilient.errors import ConfigError

__all__ = ["OpsConfig", "add_ops_flags", "ops_config"]

STATUS_MODES = ("auto", "line", "plain", "off")


@dataclass(frozen=True, slots=True)
class OpsConfig:
    """What the node's supervisor checks, serves and shows besides supervising."""

    health_checks: bool = True
    """Check this node before every rendezvous round; a node that fails does not join."""
    health_check_cmd: tuple[str, ...] = ()
    """A user's own check (--health-check CMD): a non-zero exit marks the node unhealthy."""
    health_check_timeout_s: float = 10.0
    """A user check that runs longer fails (and, at the first round, is a usage error)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port, logged); None: off."""
    metrics_addr: str = "0.0.0.0"
    status: str = "auto"
    """The live status line: "line" (one line redrawn), "plain" (periodic lines), "off";
    "auto" is "line" on a terminal, else "plain"."""
    status_every_s: float = 30.0
    """How often "plain" prints."""
    evict_stragglers: bool = False
    """Leave this node out at the next restart when its straggler score stays below
    straggler_threshold for straggler_windows windows (and --nnodes allows it)."""
    straggler_threshold: float = 0.5
    straggler_windows: int = 3

    def __post_init__(self) -> None:
        if self.health_check_timeout_s <= 0:
            raise ConfigError(
                f"--health-check-timeout must be > 0 seconds, got {self.health_check_timeout_s}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.status not in STATUS_MODES:
            raise ConfigError(
                f"--status must be one of {', '.join(STATUS_MODES)}, got {self.status!r}"
            )
        if not self.status_every_s > 0:
            raise ConfigError(f"--status-every must be > 0 seconds, got {self.status_every_s}")
        if not 0 < self.straggler_threshold < 1:
            raise ConfigError(
                "--straggler-threshold is a score (the median rank's step time over this "
                f"node's slowest rank's) in (0, 1), got {self.straggler_threshold}"
            )
        if self.straggler_windows < 1:
            raise ConfigError(f"--straggler-windows must be >= 1, got {self.straggler_windows}")


def add_ops_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("operating (docs/operating.md)")
    g.add_argument(
        "--no-health-check",
        action="store_true",
        help="skip the node's health checks before each rendezvous round",
    )
    g.add_argument(
        "--health-check",
        default=None,
        metavar="CMD",
        help="your own node check, run before each round: a non-zero exit marks the node "
        "unhealthy and it does not join",
    )
    g.add_argument("--health-check-timeout", type=float, default=10.0, metavar="SECONDS")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics of this node's run on PORT (/metrics)",
    )
    g.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDR")
    g.add_argument(
        "--status",
        default="auto",
        choices=STATUS_MODES,
        help="live status: one redrawn line on a terminal (auto), periodic lines otherwise",
    )
    g.add_argument("--status-every", type=float, default=30.0, metavar="SECONDS")
    g.add_argument(
        "--evict-stragglers",
        action="store_true",
        help="leave this node out at the next restart when one of its ranks stays a straggler "
        "(needs --nnodes MIN:MAX with room to shrink)",
    )
    g.add_argument("--straggler-threshold", type=float, default=0.5, metavar="SCORE")
    g.add_argument("--straggler-windows", type=int, default=3, metavar="K")


def ops_config(args: argparse.Namespace) -> OpsConfig:
    """The OpsConfig of a parsed command line; raises ConfigError on a bad value."""
    cmd: tuple[str, ...] = ()
    if args.health_check is not None:
        try:
            cmd = tuple(shlex.split(args.health_check))
        except ValueError as e:
            raise ConfigError(f"--health-check {args.health_check!r}: {e}") from e
        if not cmd:
            raise ConfigError("--health-check is empty: give a command, e.g. 'nvidia-smi -L'")
        if shutil.which(cmd[0]) is None:
            raise ConfigError(f"--health-check: {cmd[0]!r} is not an executable file or on PATH")
    cfg = OpsConfig(
        health_checks=not args.no_health_check,
        health_check_cmd=cmd,
        health_check_timeout_s=args.health_check_timeout,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        status=args.status,
        status_every_s=args.status_every,
        evict_stragglers=args.evict_stragglers,
        straggler_threshold=args.straggler_threshold,
        straggler_windows=args.straggler_windows,
    )
    if cfg.metrics_port:
        _check_port_free(cfg.metrics_addr, cfg.metrics_port)
    return cfg


def _check_port_free(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--metrics-port {port}: the port is in use on {addr}; pick a free one "
                    "(or 0 for any)"
                ) from e
            raise ConfigError(f"--metrics-port {port} on {addr}: {e.strerror}") from e
