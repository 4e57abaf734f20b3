"""How the Runtime builds its parts: the event log, snapshots, DDP's buckets, and a bounded
wait for a call that may never return.

The Runtime (runtime/runtime.py) is the composition root: it calls these while it wires its
collaborators together, so that its own class holds only what it decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from resilient import events as ev
from resilient import log, proctree
from resilient.checkpoint import TrainState
from resilient.data import worker_start
from resilient.data.batches import ResumableBatches
from resilient.envvars import ENV_RUN_DIR, HotMode
from resilient.errors import CheckpointCorruptError, CheckpointError, ConfigError
from resilient.groups.ddp import ddp_modules, forward_unsynced, pin_buckets
from resilient.groups.groups import DistContext, abandon_distributed, env_identity
from resilient.hang.probes import LocalStall
from resilient.hot.recovery import HotRecovery
from resilient.memory.replica import BuddyReplicas
from resilient.memory.snapshot import Snapshots
from resilient.mesh import MeshLayout
from resilient.mesh.discover import discover
from resilient.numeric.detect import NumericWatch
from resilient.runtime.config import RuntimeConfig
from resilient.runtime.stages import even_micro_batches

__all__ = [
    "abandon",
    "layout",
    "open_log",
    "peel_worker_init",
    "pin_ddp_buckets",
    "snapshots",
    "watch_worker_starts",
    "within",
]


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


def layout(
    model: nn.Module | None, mesh: Any, roles: dict[str, str] | None, ctx: DistContext, logger: Any
) -> MeshLayout:
    """The run's mesh by role (resilient/mesh/), said in a `mesh.layout` event when it is
    more than one flat data-parallel dimension."""
    rank = ctx.rank
    found = discover(model, mesh, world_size=ctx.world_size, roles=roles)
    if len(found.dims) > 1 or found.model_parallel:
        logger.info(
            "mesh.layout",
            mesh=found.describe(),
            roles={d.name: d.role for d in found.dims},
            dp=found.dp_degree,
            dp_rank=found.dp_rank(rank),
        )
    return found


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


def stage_hooks(model: nn.Module | None, rt: Any) -> list[Any]:
    """A pipeline stage's hooks (`model`: None when not pipelined): its micro-batches must
    be of one size (runtime/stages.py), and its DDP modules run every forward under
    no_sync(), as the schedules' own micro-batch forwards do (groups/ddp.py,
    forward_unsynced): their shape inference's forward would otherwise make the first step
    of every process reduce other floats than the later steps, and a resumed run drift.
    `rt`: the Runtime (its step, its logger). Returns the hooks' handles."""
    hooks: list[Any] = [] if model is None else [even_micro_batches(model, lambda: rt.step)]
    for ddp in [] if model is None else ddp_modules(model):
        hooks += forward_unsynced(ddp)
    if len(hooks) > 1:
        rt.log.info("pipeline.ddp", forwards="no_sync", modules=len(hooks) // 2)
    return hooks


def within(
    seconds: float,
    fn: Callable[[], Any],
    meanwhile: Callable[[], Any] | None = None,
    every_s: float = 0.25,
) -> bool:
    """Run `fn` on a daemon thread, ignoring what it raises; False when it has not returned
    within `seconds` (it runs on: a call that lost its peer may never return). `meanwhile`
    runs every `every_s` while it waits (what it raises is ignored too)."""
    done = threading.Event()

    def run() -> None:
        with contextlib.suppress(BaseException):
            fn()
        done.set()

    over = threading.Event()  # `meanwhile` never runs once this call returned

    def beside() -> None:  # on a thread of its own: a `meanwhile` that blocks (a store
        # call) must not keep the caller past `seconds`
        while not done.wait(every_s) and not over.is_set():
            with contextlib.suppress(BaseException):
                meanwhile()  # type: ignore[misc]

    threading.Thread(target=run, name="resilient-drain", daemon=True).start()
    if meanwhile is not None:
        threading.Thread(target=beside, name="resilient-drain-meanwhile", daemon=True).start()
    finished = done.wait(seconds)
    over.set()
    return finished


def abandon(rt: Any, drain_s: float) -> bool:
    """Runtime.abandon's teardown, after a peer was lost: stop the threads and hooks, let a
    save or replica exchange in flight fail or finish (up to `drain_s`; False when it did
    not), note a save that did not commit (rt.lost_save), destroy the process groups."""
    rt.watchdog.stop(barrier=False)
    rt.preemption.uninstall()
    rt._uninstall_excepthook()
    for h in rt._hooks:
        h.remove()
    rt._hooks = []
    # a save or replica exchange that lost the peer fails (one on a leaver's: cut loose)
    if not drain(drain_s, rt.checkpoints.wait, rt.watchdog):
        return False
    replicas = rt.snapshots.replicas
    if replicas is not None and not drain(drain_s, replicas.wait, rt.watchdog):
        return False
    if rt._saved_step is not None and rt.checkpoints.last_committed != rt._saved_step:
        rt.lost_save = rt._saved_step
    with contextlib.suppress(BaseException):
        rt.checkpoints.close()
    abandon_distributed(rt.ctx, None if replicas is None else replicas.group)
    return True


def drain(seconds: float, wait: Callable[[], Any], watchdog: Any) -> bool:
    """`within` for a survivor leaving its generation: while `wait` (its save or replica
    exchange in flight) runs, cut its connections to the other survivors that left, whose
    threads may wait on its own (Watchdog.cut_departed)."""
    every = watchdog.config.heartbeat_interval_s
    return within(seconds, wait, meanwhile=watchdog.cut_departed, every_s=every)


def at_least_warning(level: str) -> str:
    order = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    return order[max(order.index(level.upper()), 2)]


def init_weights(config: RuntimeConfig, state: TrainState | None, group: Any) -> None:
    """A start with no checkpoint of the run's own: take `config.init_from`'s model (and,
    from a resilient checkpoint, the parts `init_with` names) into the tracked state. Every
    rank calls it; the step count stays 0."""
    from resilient.checkpoint import CheckpointConfig, CheckpointManager
    from resilient.weights.load import load_model
    from resilient.weights.sources import identify

    if state is None or state.model is None:
        raise ConfigError("init_from needs a model: call rt.track(model=...) before steps()")
    src, logger = str(config.init_from), log.get_logger()
    parts = set(config.init_with)
    if parts == {"model"}:
        done = load_model(
            src,
            state.model,
            step=config.init_step,
            exclude=config.init_exclude,
            storage_options=config.checkpoint.storage_options,
            process_group=group,
        )
        logger.info("init.from", source=src, kind=done.kind, step=done.step, took=["model"])
        return
    source = identify(src, step=config.init_step)
    if source.kind != "resilient":
        raise ConfigError(
            f"init_with={list(config.init_with)} needs a resilient checkpoint as init_from: "
            f"{src} is a {source.kind} file, which holds the model's weights alone"
        )
    sub = TrainState(
        model=state.model,
        optimizer=state.optimizer if "optimizer" in parts else None,
        common={
            k: v
            for k, v in state.common.items()
            if (k == "scheduler" and "scheduler" in parts) or (k == "__data__" and "data" in parts)
        },
        per_rank=dict(state.per_rank) if "data" in parts else {},
        rng="rng" in parts,
        layout=state.layout,
    )
    mgr = CheckpointManager(
        CheckpointConfig(
            url=source.url, storage_options=config.checkpoint.storage_options, async_save=False
        ),
        process_group=group,
    )
    try:
        steps = mgr.candidates()
        step = source.step if source.step is not None else (steps[0] if steps else None)
        if step is None or step not in steps:
            raise CheckpointError(
                f"init_from {source.url}: no committed checkpoint"
                + (f" at step {step} (it has {sorted(steps)})" if steps else "")
            )
        if not mgr.try_load(sub, step):
            raise CheckpointCorruptError(
                f"init_from {source.url} step {step} failed verification; the ckpt.fallback "
                "event names the file. Nothing was loaded."
            )
    finally:
        mgr.close()
    logger.info("init.from", source=src, kind="resilient", step=step, took=sorted(parts))


def replicated_grads(model: nn.Module | None) -> bool:
    """Every rank holds the same reduced gradients at optimizer.step(): a DDP model without
    sharded (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    if model is None or not ddp_modules(model):
        return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def numeric_hooks(
    watch: NumericWatch, model: nn.Module | None, optimizer: Any, pipelined: bool = False
) -> list[Any]:
    """The numerical check's hook on `optimizer.step()` (resilient/numeric/detect.py). A
    pipeline's stages hold other gradients (a NaN born in a later stage's backward never
    reaches an earlier one, and the loss is on the last stage only), so their check is
    agreed over every rank, as for sharded gradients, even when DDP reduces each stage's."""
    replicated = replicated_grads(model) and not pipelined
    hook = watch.attach(optimizer, replicated=replicated)
    return [] if hook is None else [hook]


def peel_worker_init(loader: Any) -> None:
    """Give `loader` back its own worker_init_fn, without the runtime's wrappers."""
    fn = getattr(loader, "worker_init_fn", None)
    while getattr(fn, "resilient_wrapper", False):
        fn = fn.inner  # type: ignore[union-attr]
    if hasattr(loader, "worker_init_fn"):
        loader.worker_init_fn = fn


def watch_worker_starts(
    rt: Any, loader: Any, batches: ResumableBatches, old: worker_start.WorkerStarts | None
) -> worker_start.WorkerStarts | None:
    """On an interpreter that can deadlock a forked child (data/worker_start.py), say so once
    and have the watchdog name a loader worker stuck in its fork after
    `worker_start_timeout_s`, instead of the phase's timeout (6 min in an attempt's first
    step). Elsewhere, or for a loader that does not fork, nothing. Replaces `old` (the
    previous track's)."""
    if old is not None:
        old.close()
    rt.watchdog.probes.set("worker_start", None)
    if not (worker_start.fork_deadlock_prone() and worker_start.forks_workers(loader)):
        return None
    after_s = float(rt.config.watchdog.worker_start_timeout_s)
    watching = rt.config.watchdog.enabled
    rt.log.warning(
        ev.DATA_FORK_DEADLOCK_PRONE,
        num_workers=int(loader.num_workers),
        named_after_s=after_s if watching else None,
        fix=worker_start.python_fix(),
    )
    if not watching:
        return None
    starts = worker_start.WorkerStarts(loader)

    def look() -> LocalStall | None:
        since = batches.iter_started_at
        stuck = starts.stuck(since, after_s)
        if not stuck or since is None:
            return None
        # they hold nothing, and would outlive their rank's exit
        proctree.kill_tree(stuck[0], also=stuck[1:], wait_s=0)
        age = time.time() - since
        return LocalStall(
            reason=f"loader worker(s) {stuck} forked {age:.1f} s ago never started: stuck in "
            "their fork (a CPython bug: a lock another thread held at the fork); "
            f"{worker_start.python_fix()}",
            timeout_kind="worker_start",
            timeout_s=after_s,
            age_s=age,
            detail={"stuck_workers": stuck},
        )

    rt.watchdog.probes.set("worker_start", look)
    return starts
