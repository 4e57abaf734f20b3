"""The coordinated stop on preemption: every rank agrees on one step, saves, and leaves.

The Runtime asks `check_preempt` at step boundaries (preempt/watch.py decides when an
agreement is due); once every rank agreed, `stop_preempted` finishes the save in flight or
makes the final one within the grace period, closes the Runtime and raises Preempted, which
the process turns into ExitCode.PREEMPTED.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn, Protocol

import torch.distributed as dist

from resilient.checkpoint import CheckpointStore
from resilient.errors import CheckpointError
from resilient.exitcodes import ExitCode
from resilient.groups.exits import exit_now
from resilient.guard.guard import Guard
from resilient.hang.phases import Phase
from resilient.hang.watchdog import Watchdog
from resilient.preempt.watch import Preempted, PreemptionWatch

__all__ = ["Stoppable", "check_preempt", "stop_preempted"]


class Stoppable(Protocol):
    """What the stop needs of the Runtime."""

    step: int
    log: Any
    checkpoints: CheckpointStore
    watchdog: Watchdog
    preemption: PreemptionWatch
    guards: Guard

    def save(self, *, blocking: bool | None = None) -> None: ...

    def close(self) -> None: ...


def check_preempt(rt: Stoppable, resumed_at: int, *, force: bool = False) -> None:
    """Agree across ranks whether a preemption signal arrived; if so, stop (never returns).
    A collective on the control group when due (or `force`): every rank calls it alike."""
    try:
        with rt.watchdog.phase(Phase.AGREE):
            stop = rt.preemption.agree(force=force)
    except (RuntimeError, dist.DistError) as e:  # a peer died during the agreement
        if rt.preemption.requested:  # leaving anyway; the group cannot save now
            exit_now(ExitCode.PEER_LOST, kind="preempt_group_lost", error=str(e)[:300])
        rt.guards.fail_fast(e)
    if stop:
        stop_preempted(rt, resumed_at)


def stop_preempted(rt: Stoppable, resumed_at: int) -> NoReturn:
    """Every rank agreed to stop before the next step: finish or make the final save within
    the grace period, leave the process groups, raise Preempted (exit ExitCode.PREEMPTED).
    `resumed_at` is the step this attempt started from: with no step done since, there is
    nothing new to save."""
    watch, log, step, mgr = rt.preemption, rt.log, rt.step, rt.checkpoints
    log.warning(
        "preempt.stop",
        step=step,
        signal=watch.signal_name,
        signalled_here=watch.requested,
        since_signal_s=watch.since_signal_s(),
        remaining_s=round(watch.remaining_s(), 3),
    )
    try:
        with rt.watchdog.phase(Phase.CHECKPOINT):
            t0 = time.monotonic()
            if mgr.wait() is not None:  # the async save in flight: finish and commit it
                log.info(
                    "preempt.flushed",
                    step=mgr.last_committed,
                    wait_s=round(time.monotonic() - t0, 4),
                )
            if step not in (mgr.last_committed, resumed_at):
                fits, estimate, left = watch.budget(watch.save_estimate_s)
                if fits:
                    t1 = time.monotonic()
                    rt.save(blocking=True)
                    if mgr.last_committed == step:
                        log.warning(
                            "preempt.committed",
                            step=step,
                            save_s=round(time.monotonic() - t1, 4),
                            since_signal_s=watch.since_signal_s(),
                        )
                else:
                    log.error(
                        "preempt.skip_save",
                        step=step,
                        estimate_s=round(estimate, 3),
                        remaining_s=round(left, 3),
                        newest_valid=mgr.last_committed,
                    )
    except CheckpointError as e:  # the previous checkpoint stays the newest valid one
        log.error(
            "preempt.save_failed",
            step=step,
            error=str(e)[:500],
            newest_valid=mgr.last_committed,
        )
    committed = mgr.last_committed
    rt.close()
    log.warning(
        "preempt.exit",
        step=step,
        committed=committed,
        code=int(ExitCode.PREEMPTED),
        since_signal_s=watch.since_signal_s(),
        agree_checks=watch.checks,
        agree_mean_us=round(1e6 * watch.check_s / watch.checks, 1) if watch.checks else None,
    )
    raise Preempted(step=step, committed=committed)
