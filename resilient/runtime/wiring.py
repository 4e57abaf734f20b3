"""How the Runtime builds its parts: the event log, snapshots, the save fences, DDP's
buckets, and a bounded wait for a call that may never return.

The Runtime (runtime/runtime.py) is the composition root: it calls these while it wires its
collaborators together, so that its own class holds only what it decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from resilient import log
from resilient.dist.ddp import ddp_modules, pin_buckets
from resilient.dist.groups import DistContext, env_identity
from resilient.envvars import ENV_RUN_DIR, HotMode
from resilient.hot.recovery import HotRecovery
from resilient.memory.replica import BuddyReplicas
from resilient.memory.snapshot import Snapshots
from resilient.runtime.config import RuntimeConfig

__all__ = ["fences", "open_log", "pin_ddp_buckets", "snapshots", "within"]


def open_log(config: RuntimeConfig) -> tuple[str, Path | None]:
    """Configure this rank's event log; its run directory and log file."""
    rank, restart, run_id = env_identity()
    run_dir = config.run_dir or os.environ.get(ENV_RUN_DIR) or os.path.join("runs", run_id)
    run_dir = os.path.abspath(run_dir)
    level = config.console_level
    log_path = log.configure(
        run_dir=run_dir,
        run_id=run_id,
        rank=rank,
        restart=restart,
        # one voice on the console: other ranks show only warnings and errors
        console_level=level if rank == 0 else at_least_warning(level),
    )
    return run_dir, log_path


def snapshots(
    config: RuntimeConfig, ctx: DistContext, mode: HotMode, hot: HotRecovery | None
) -> Snapshots:
    """In-memory snapshots (memory/). Hot recovery restores from them, so it turns them on,
    and sends them off the rank: a copy to a buddy (memory/replica.py), or the per-rank part
    (a few KiB) to the launcher's store."""
    snap = config.snapshot
    if mode.enabled and ctx.distributed and not snap.enabled:
        snap = dataclasses.replace(snap, enabled=True)
    return Snapshots(
        snap,
        ctx,
        replicas=BuddyReplicas(ctx, timeout_s=config.side_timeout_s)
        if hot is not None and snap.replicas
        else None,
        replicate=hot.put_replica if hot is not None and not snap.replicas else None,
    )


def fences(model: nn.Module | None, optimizer: Any, fence: Callable[[], Any]) -> list[Any]:
    """Hooks that wait for an async save's staging before anything changes the state it
    copies (pytorch#144657): parameters and optimizer state change in step(), buffers
    (BatchNorm statistics, DDP's buffer broadcast) in forward()."""
    hooks = []
    if optimizer is not None:
        hooks.append(optimizer.register_step_pre_hook(lambda *_: fence()))
    if model is not None and any(True for _ in model.buffers()):
        hooks.append(model.register_forward_pre_hook(lambda *_: fence()))
    return hooks


def pin_ddp_buckets(model: nn.Module, logger: Any) -> None:
    """Fix every DDP module's gradient buckets in `model` (RuntimeConfig.pin_ddp_buckets)."""
    for ddp in ddp_modules(model):
        outcome = pin_buckets(ddp)
        if outcome in ("pinned", "never_rebuilt"):
            logger.info("ddp.buckets", outcome=outcome)
        else:  # exact resume on 3+ ranks is then up to the script
            logger.warning(
                "ddp.buckets",
                outcome=outcome,
                note="bucket layout not fixed: on 3+ ranks the first step after a "
                "resume may sum gradients in another order (call track() before "
                "the first forward)",
            )


def within(seconds: float, fn: Callable[[], Any]) -> bool:
    """Run `fn` on a daemon thread, ignoring what it raises; False when it has not returned
    within `seconds` (it runs on: a call that lost its peer may never return)."""
    done = threading.Event()

    def run() -> None:
        with contextlib.suppress(BaseException):
            fn()
        done.set()

    threading.Thread(target=run, name="resilient-drain", daemon=True).start()
    return done.wait(seconds)


def at_least_warning(level: str) -> str:
    order = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    return order[max(order.index(level.upper()), 2)]
