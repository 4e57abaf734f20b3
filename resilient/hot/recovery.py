"""Hot recovery of a lost process: the survivors re-run the script in place.

Under `resilient run --hot-recovery` every worker runs the script through the worker wrapper
(resilient/worker.py), and every rank keeps in-memory snapshots (memory/snapshot.py). When a
worker dies (kill -9, a crash, an OOM exit):

1. The agent notices the exit, starts a replacement for that one local rank with
   RESILIENT_GENERATION=g+1, and publishes generation g+1 on the store
   (supervisor/hot.py). It does not stop the other workers.
2. A survivor notices the loss as a failed collective (the guard's "peer" classification:
   gloo reports a closed connection at once). Instead of exiting it calls
   `HotRecovery.restart()`: it keeps its snapshots (hot/carry.py), takes its Runtime down
   without waiting on the lost peer (threads stopped, an in-flight save drained, process
   groups destroyed) and raises HotRestart, a BaseException that unwinds the user's script
   up to the wrapper.
3. The wrapper waits for generation g+1 (hot/reform.py) and runs the script again, in the
   same process: python and torch stay imported, the script builds its model and optimizer
   again and joins the new generation's process groups under their own store prefix, after
   a roll call of every rank.
4. Every rank then resumes in `Runtime.resume()` through `HotRecovery.resume()`, with one
   collective agreement on the newest snapshot step every rank can restore (hot/restore.py):
   a survivor from its own snapshot, the replacement from a survivor and from the replica of
   its per-rank state that the lost rank sent its buddy at each snapshot
   (memory/replica.py; with replicas=0 it left it in the launcher's store instead). FSDP2
   shards come from the buddy's replica of the whole snapshot. Durable checkpoints are not
   read; a durable save the loss interrupted is made again at the resumed step when the
   replay would not make it (Resumed.catch_up).

Why the script is re-run rather than the survivors patching their live objects: a replacement
runs the whole start-up of the script (process groups, DDP's construction broadcast, the
bucket pinning, the agreements of init()), and a survivor mid-step would have to mirror each
of those collectives, in order, from wherever it was. Re-running the script makes every rank
run the same code, so the collectives match by construction.

Anything that cannot go hot goes cold (the agent's ordinary restart) with a reason: no
snapshot step every rank can restore, no generation published within `HotMode.wait_s`
seconds, a save that does not drain, a second loss during recovery (the agent's rule).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NoReturn

import torch.distributed as dist

from resilient import events as ev
from resilient.envvars import HotMode
from resilient.exitcodes import ExitCode
from resilient.groups.exits import exit_now
from resilient.hot import carry, gapwatch, reform, restore
from resilient.hot.host import RecoveryHost
from resilient.log import get_logger
from resilient.memory.replica import localize

__all__ = ["DRAIN_S", "GAP_S", "HotRecovery", "HotRestart", "divert_escaped"]

DRAIN_S = 10.0
"""How long a survivor waits for an in-flight async save or replica to fail or finish."""
GAP_S = 2 * DRAIN_S + 15.0
"""How long a survivor may take from leaving its generation until its garbage is collected
(hot/gapwatch.py): its two drains, and 15 s for the rest, which takes under a second."""


class HotRestart(BaseException):
    """Unwinds the user's script to the worker wrapper, which runs it again in place.

    A BaseException, so `except Exception` in a training loop does not swallow it."""

    def __init__(self, generation: int, reason: str) -> None:
        super().__init__(f"hot recovery to generation {generation}: {reason}")
        self.generation = generation
        self.reason = reason


class HotRecovery:
    """Hot recovery for one Runtime (`host`), built by it when hot recovery is on and the
    process is one of several with the launcher's store. The guard calls `restart` on a
    lost peer and `leave_for_replacement` on this rank's own failure; the Runtime calls
    `resume` and `mark_stepped`."""

    def __init__(self, host: RecoveryHost, mode: HotMode) -> None:
        self.host = host
        self.mode = mode
        self.store: Any = host.ctx.base_store

    @property
    def rejoining(self) -> bool:
        """This Runtime runs a generation after a hot recovery: it restores from memory."""
        return self.mode.rejoining

    def put_replica(self, held: dict[int, bytes]) -> None:
        """The per-rank part of the snapshots this rank holds, for a replacement (replicas=0)."""
        restore.put_replica(self.store, self.mode, self.host.rank, held)

    # ------------------------------------------------------------ a survivor
    def restart(self, exc: BaseException) -> NoReturn:
        """On a survivor that saw a peer's loss: keep the snapshots, take the Runtime down
        without waiting on the lost peer, and unwind to the wrapper (HotRestart). Exits
        PEER_LOST (cold) when that cannot be done."""
        host, log = self.host, get_logger()
        t0 = time.monotonic()
        gen = self.mode.generation + 1
        snaps = host.snapshots
        # DTensors would not survive their mesh's process groups: keep their shards
        held = {s: localize(b) for s, b in snaps.held_buffers().items()}
        step = host.watchdog.progress.step
        log.warning(
            ev.RECOVERY_HOT_DETECT,
            step=step,
            error=f"{type(exc).__name__}: {str(exc)[:300]}",
            held=sorted(held),
            next_generation=gen,
        )
        if not held or self.store is None:
            self._cold("no in-memory snapshot on this rank yet" if not held else "no store")
        gapwatch.arm(host.watchdog.stacks_path, GAP_S, generation=gen)  # worker.py disarms
        # a peer may wait on this rank, not on the lost one, in a sub-group's collective (a
        # mesh): it cuts its connections to this process (hang/departed.py)
        host.watchdog.announce_departure()
        if not host.abandon(drain_s=DRAIN_S):
            why = f"an in-flight async save or replica did not finish within {DRAIN_S:g} s"
            with contextlib.suppress(OSError):  # where its thread waits, for the next look
                host.watchdog.dump_stacks(why)
            self._cold(why)
        replicas = snaps.replicas
        carry.keep(
            carry.Carry(
                generation=gen,
                keys=self.mode.keys,
                wait_s=self.mode.wait_s,
                steps=sorted(held),
                buffers=held,
                store=self.store,
                detected_at=t0,
                reason=str(exc)[:300],
                step=step,
                lost_save=host.lost_save,
                sharded=snaps.sharded,
                ward=replicas.ward if replicas is not None and replicas.ward >= 0 else None,
                replica=replicas.held() if replicas is not None else {},
                timings={"teardown_s": time.monotonic() - t0},
                interval=snaps.interval_state(),
            )
        )
        raise HotRestart(gen, str(exc)[:200])

    def leave_for_replacement(self, exc: BaseException, kind: str, split: int) -> None:
        """On the rank whose own step raised `exc` outside the guard's in-place agreement
        (FSDP2, `rt.guard()`, an exception that escaped the loop): leave this process alone,
        with the failure's exit code and no verdict for the others, so that the agent
        replaces it with a warm spare and the survivors re-form around it, as after a kill
        -9. Returns when the group must go cold instead, after saying why: the caller then
        takes its usual path.

        Why the process goes and is not kept: its peers may be blocked in a collective it
        will never enter (FSDP2's all-gathers, DDP's gradient all-reduce). gloo cannot abort
        one, and the connection closes only when the last reference to its process group
        dies; torch's DTensor caches keep the mesh, and with it the group, alive in this
        process. A closed process is the one signal every peer gets at once
        (docs/hot-recovery.md).

        The same failure (rank, step, kind, micro-batch split) a second time in this attempt
        goes cold (SnapshotConfig.max_retries_per_step): a replay that fails the same way
        again would otherwise be replaced until --hot-max ran out."""
        host, keys, gen = self.host, self.mode.keys, self.mode.generation
        step = host.watchdog.progress.step
        reason = None
        try:
            times = int(self.store.add(keys.raised(host.rank, step, kind, split), 1))
            if times > host.snapshots.config.max_retries_per_step:
                reason = f"the same failure at the same step again ({times} times)"
            elif gen and not self.store.check([keys.formed(gen)]):
                reason = f"a failure while generation {gen} was still forming"
        except (RuntimeError, dist.DistError, ValueError) as e:
            reason = f"the store failed: {e}"
        if reason is not None:
            get_logger().error(
                ev.ROLLBACK_REFUSED, step=step, failed_rank=host.rank, reason=reason, hot=True
            )
            return
        replicas = host.snapshots.replicas
        if replicas is not None:  # the buddy's copy of this rank's newest snapshot: let it land
            replicas.wait(DRAIN_S)
        code = ExitCode.OOM if kind == "oom" else ExitCode.RANK_EXCEPTION
        exit_now(code, kind="hot_replacement", reason=f"{type(exc).__name__} at step {step}")

    def _cold(self, reason: str) -> NoReturn:
        get_logger().error(ev.RECOVERY_COLD, reason=reason, rank=self.host.rank)
        exit_now(ExitCode.PEER_LOST, kind="peer_lost", reason=f"hot recovery refused: {reason}")

    # ------------------------------------------------------------ every rank of a new generation
    def resume(self) -> restore.Resumed | None:
        """Restore the newest snapshot step every rank holds (hot/restore.py); None: load
        from storage as a cold start would. A collective on the control group."""
        try:
            return restore.resume(self.host, self.mode)
        except ValueError as e:
            self._cold(str(e))

    def mark_stepped(self) -> None:
        """Rank 0: the generation's first step closed (the agent starts its next spare)."""
        reform.mark_stepped(self.store, self.mode)


def divert_escaped(recovery: Any, exc: Exception) -> bool:
    """For the worker wrapper: an exception escaped the script while this process's Runtime
    is still up (`recovery`: its guard's `on_uncaught`, or None when no Runtime is up). When
    it is a peer's loss, the guard takes it (a HotRestart, or a cold exit with the reason)
    and this returns True; anything else is the script's own: False."""
    if recovery is None:
        return False
    try:
        recovery(exc)
    except HotRestart:
        return True
    return False
