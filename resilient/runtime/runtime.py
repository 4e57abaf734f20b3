"""The in-worker runtime: what `resilient.init()` returns.

It owns the process groups, the event log, the tracked training state, resuming from the
newest valid checkpoint, saving, and the coordinated stop on preemption. The loops between
(`steps()`, `epochs()`, the save policy) are in resilient/runtime/loops.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from resilient import events as ev
from resilient import log
from resilient.checkpoint import TrainState, open_manager
from resilient.checkpoint.state import StatefulLike
from resilient.data.batches import ResumableBatches
from resilient.data.position import DataPosition
from resilient.data.worker_start import WorkerStarts
from resilient.envvars import HotMode, parse_signals
from resilient.errors import ConfigError
from resilient.groups.groups import DistContext, init_distributed, shutdown_distributed
from resilient.guard.guard import Guard
from resilient.guard.microbatch import MicroBatch
from resilient.hang.phases import Phase
from resilient.hang.watchdog import Watchdog
from resilient.hot import carry, reform
from resilient.hot.recovery import HotRecovery
from resilient.mesh import MeshLayout
from resilient.numeric.detect import NumericWatch
from resilient.preempt.loader_workers import shield_workers
from resilient.preempt.watch import PreemptionWatch
from resilient.replay.fingerprint import StepFingerprints
from resilient.replay.grads import CarriedGrads
from resilient.runtime import wiring
from resilient.runtime.config import RuntimeConfig, build_config
from resilient.runtime.errorfile import install_excepthook
from resilient.runtime.loops import Loops
from resilient.runtime.numeric import NumericResponse
from resilient.runtime.progress import ProgressLog
from resilient.runtime.stages import agree_split
from resilient.runtime.stopping import check_preempt

__all__ = ["Runtime", "current", "init"]


def init(checkpoint_dir: str | os.PathLike[str] | None = None, **options: Any) -> Runtime:
    """Join the process group launched by torchrun and return the Runtime.

    `checkpoint_dir` is a local directory or fsspec URL (default $RESILIENT_CHECKPOINT_DIR,
    else ./checkpoints). `options` are fields of RuntimeConfig or CheckpointConfig, e.g.
    `save_every_steps=50, keep_last=2, async_save=False`. Raises ConfigError on an unknown
    option or a value out of range. Waits up to `pg_timeout_s` for the other ranks.
    """
    return Runtime(build_config(checkpoint_dir, options))


_current: Runtime | None = None


def current() -> Runtime:
    """The Runtime that init() returned in this process (for code that cannot be handed it,
    e.g. a Trainer class built after init()). Raises RuntimeError before init() or after
    close()."""
    if _current is None:
        raise RuntimeError("no resilient Runtime in this process: call resilient.init() first")
    return _current


class Runtime(Loops):
    """Resumable, checkpointed training around a user's loop. Create it with `init()`."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        # the log first: what happens while the process group forms is logged there too
        self.run_dir, self.log_path = wiring.open_log(config)
        mode = HotMode.from_env()  # the one read of hot recovery's environment
        self.ctx: DistContext = init_distributed(
            backend=config.backend,
            timeout_s=config.pg_timeout_s,
            side_timeout_s=config.side_timeout_s,
            store=carry.store(),
            # a hot generation: a roll call of every rank before the groups form (hot/reform.py)
            before_group=(
                (lambda st, r, w: reform.roll_call(st, r, w, config.watchdog, mode))
                if mode.rejoining
                else None
            ),
            generation=mode.generation,
            connect_side=mode.enabled,  # hot: no wait on a pair that never connected
        )
        self.log = log.get_logger()
        self.state = TrainState()
        # one tier, or local + remote when config.checkpoint.local_url is set
        self.checkpoints = open_manager(config.checkpoint, process_group=self.ctx.checkpoint_group)
        self.step = 0
        """Steps completed so far (the step a checkpoint taken now would carry)."""
        self._batches: ResumableBatches | None = None
        self._worker_starts: WorkerStarts | None = None  # data/worker_start.py
        self._resumed = False
        self._last_save_time = time.monotonic()
        self._hooks: list[Any] = []
        self._progress = ProgressLog(self.log)
        self._abandoned = False
        self.lost_save: int | None = None
        """After abandon(): the step of a save started here that did not commit (its write
        lost the peer), for the hot resume's catch-up save."""
        # heartbeats, the hang monitor and verdicts (hang/)
        self.watchdog = Watchdog(config.watchdog, self.ctx, self.run_dir, hot=mode)
        self.watchdog.start()
        # a lost peer: re-run the script in place from the snapshots (hot/recovery.py)
        hot_on = mode.enabled and self.ctx.distributed and self.ctx.base_store is not None
        self.hot = HotRecovery(self, mode) if hot_on else None
        self.snapshots = wiring.snapshots(config, self.ctx, mode, self.hot)
        # the OOM/exception agreement (guard/): may roll back in place, or go hot
        self.guards = Guard(
            self.watchdog,
            self.ctx,
            self.run_dir,
            rollback=self.snapshots.agree_rollback if self.snapshots.enabled else None,
            recovery=self.hot,
            stop_requested=lambda: self.preemption.requested,
        )
        self.guards.resume_split()
        # preemption: signals become a stop at an agreed step (preempt/, runtime/stopping.py)
        self.preemption = PreemptionWatch(
            config.preempt,
            group=self.ctx.control_group,
            distributed=self.ctx.distributed,
            leave_now=lambda: self.guards.failing,
        )
        self._uninstall_excepthook = install_excepthook(
            lambda: self.step, divert=self.guards.on_uncaught
        )
        self._data: DataPosition | None = None
        self.layout = MeshLayout.flat(self.ctx.world_size)  # the mesh by role, set in track()
        self._fp = StepFingerprints(self.log, world=self.ctx.world_size)
        self._carried = CarriedGrads(self.log)  # grads.carried: .grad across a step boundary
        self.numeric = NumericWatch(config.numeric, self.ctx)  # numerical faults (numeric/)
        self._numeric = NumericResponse(self)
        self._init_loops()  # resilient/runtime/loops.py
        global _current
        _current = self
        self.log.info(
            ev.RUNTIME_INIT,
            world_size=self.ctx.world_size,
            generation=mode.generation,
            backend=self.ctx.backend,
            host=self.ctx.host,
            local_rank=self.ctx.local_rank,
            checkpoint_url=config.checkpoint.url,
            run_dir=self.run_dir,
        )

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    # ------------------------------------------------------------------ tracking
    def track(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        loader: Any = None,
        global_batch_size: int | None = None,
        mesh: Any = None,
        mesh_roles: dict[str, str] | None = None,
        **extras: StatefulLike,
    ) -> None:
        """Register what a checkpoint holds. Call once, before `steps()`.

        `loader` should be a torchdata StatefulDataLoader; iterate it through `batches()`
        so its position and epoch are checkpointed. `global_batch_size` (default: the loader's
        batch_size x dp degree) is kept on other meshes by `grad_accum`. `mesh`: the world
        DeviceMesh, dimensions named by role or `mesh_roles` (docs/porting.md#2-d-and-3-d-meshes;
        default: the DTensor parameters'). `extras` are objects with
        state_dict()/load_state_dict() that are identical on every rank (a GradScaler, ...).
        With a DDP `model` (and `pin_ddp_buckets`, the default) it fixes DDP's buckets, a
        collective on DDP's process group: every rank calls track(), before the first forward.
        """
        if self._resumed:
            raise RuntimeError("track() must be called before steps() starts")
        if optimizer is not None and model is None:
            raise ConfigError(
                "track(optimizer=...) needs model=... too (optimizer state is "
                "saved by parameter name)"
            )
        self.layout = wiring.layout(model, mesh, mesh_roles, self.ctx, self.log)
        self._fp.mesh = self.layout.signature()
        stage = agree_split(model, self.layout, self.ctx, self.log)  # None: no pp in the mesh
        common: dict[str, StatefulLike] = dict(extras)
        common.update(__numeric_skipped__=self.numeric.skipped, __hang__=self.watchdog.learned)
        if scheduler is not None:
            common["scheduler"] = scheduler
        per_rank: dict[str, StatefulLike] = {}
        if loader is not None:
            if not hasattr(loader, "state_dict"):
                raise ConfigError(
                    f"loader {type(loader).__name__} has no state_dict(): use "
                    "torchdata.stateful_dataloader.StatefulDataLoader so its position is saved"
                )
            self._batches = ResumableBatches(loader)
            # the node's health check sizes /dev/shm from it at the next round (health/host.py)
            self.log.info(
                "data.loader",
                num_workers=int(getattr(loader, "num_workers", 0) or 0),
                prefetch_factor=getattr(loader, "prefetch_factor", None),
                batch_size=getattr(loader, "batch_size", None),
            )
            # its workers must outlive a preemption signal until the agreed stop
            wiring.peel_worker_init(loader)  # tracked again: our wrappers once, not twice
            shield_workers(loader, parse_signals(",".join(self.config.preempt.signals)))
            self._worker_starts = wiring.watch_worker_starts(
                self, loader, self._batches, self._worker_starts
            )
            per_rank["loader"] = self._batches
            # world-size-independent position + global batch, for elastic resume
            self._data = DataPosition(
                self._batches, self.layout, self.rank, global_batch_size, self.config.batch_policy
            )
            common["__data__"] = self._data
        per_rank["__loss_mean__"] = self.numeric.loss_mean  # spike detection's running mean
        self.state = TrainState(model=model, optimizer=optimizer, common=common, per_rank=per_rank)
        self.state.layout, self.state.pipeline = self.layout.signature(), stage is not None
        self.snapshots.track(self.state, self.layout)  # ConfigError when the copies do not fit
        if model is not None and self.config.pin_ddp_buckets:
            wiring.pin_ddp_buckets(model, self.log)
        for h in self._hooks:
            h.remove()
        # (an async save's copy fences the model and the optimizer itself: checkpoint/pipeline.py)
        self._hooks = self.watchdog.instrument(model, optimizer, stage)  # phases, hang reports
        self._hooks += wiring.stage_hooks(None if stage is None else model, self)
        self._hooks += wiring.numeric_hooks(self.numeric, model, optimizer, stage is not None)
        if model is not None and not stage:  # each step's first forward inputs: its
            # fingerprint (pipelines: stage 0's)
            self._hooks.append(self._fp.attach(model, pipeline_stage=stage == 0))

    # ------------------------------------------------------------------ the loop
    def resume(self) -> int:
        """Load the newest valid checkpoint, if any, and return the step to continue from.

        Raises StorageError if the checkpoint location is not writable and
        CheckpointMismatchError if its checkpoints belong to another model.
        """
        if self._resumed:
            return self.step
        self.checkpoints.check_writable()
        if self.hot is not None and self.hot.rejoining:
            with self.watchdog.phase(Phase.CHECKPOINT):
                hot = self.hot.resume()  # None: no step every rank can restore
            if hot is not None:
                # a durable save lost with the peer: save the restored step at once (every
                # rank: the hot resume agreed on it), so the newest checkpoint does not fall
                # one interval further behind with each hot recovery
                self._resumed_at(hot.step, loaded=None, hot=True)
                self._numeric.resumed(self.step)
                if hot.catch_up:
                    self.save()
                return self.step
        self._numeric.adopt_recorded()
        with self.watchdog.phase(Phase.CHECKPOINT):
            loaded = self.checkpoints.load_latest(self.state)
            if loaded is None and self.config.init_from is not None:
                wiring.init_weights(self.config, self.state, self.ctx.checkpoint_group)
        self._resumed_at(loaded or 0, loaded=loaded, hot=False)
        self._numeric.resumed(self.step)
        return self.step

    def abandon(self, *, drain_s: float) -> bool:
        """Take this Runtime down after a peer was lost, without waiting on the peer: stop
        the threads, let an in-flight save fail or finish (up to `drain_s`), destroy the
        process groups. False when the save did not drain. Later calls (close(), the loop's
        own clean-up while the script unwinds) do nothing."""
        global _current
        if self._abandoned:
            return True
        self._abandoned = True
        if _current is self:
            _current = None
        return wiring.abandon(self, drain_s)  # threads, hooks, a save in flight, the groups

    def save(self, *, blocking: bool | None = None) -> None:
        """Checkpoint the tracked state at the current step (async unless configured)."""
        self._last_save_time = time.monotonic()
        self._saved_step = self.step
        sync = blocking if blocking is not None else not self.config.checkpoint.async_save
        self._numeric.check_replicas(self.step)  # DDP with sdc on: never save a corrupt replica
        self._numeric.saving(self.step)
        t0 = time.perf_counter()
        with self.watchdog.phase(Phase.CHECKPOINT):
            self.checkpoints.save(self.state, self.step, blocking=blocking)
        self._carried.at_save(self.state.model, self.step)  # the first save only
        if sync:  # what a final save on preemption will take
            self.preemption.note_save(time.perf_counter() - t0)

    # ------------------------------------------------------------------ preemption, elastic
    def _check_preempt(self, resumed_at: int, *, force: bool = False) -> None:
        """Agree whether a preemption signal arrived; if so, stop (runtime/stopping.py)."""
        check_preempt(self, resumed_at, force=force)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step that keep the global batch on this data-parallel
        degree (1 unless the run resumed on fewer data-parallel ranks, or track() got a
        global_batch_size). Where the loader's batch cannot split it, the batch policy
        decides: smaller micro-batches ("exact") or a global batch that follows the world
        ("follow"; docs/operating.md#batch-policy). Read it inside the loop: it is known once
        steps() resumed."""
        if not self._resumed:
            self.resume()
        return self._data.grad_accum if self._data is not None else 1

    @property
    def global_batch_size(self) -> int | None:
        """The global batch the steps train on now (it follows the world under "follow")."""
        return self._data.effective_batch if self._data is not None else None

    def close(self) -> None:
        """Wait for saves, leave the process groups. Safe to call twice."""
        global _current
        if self._abandoned:  # a hot recovery took it down already
            return
        if _current is self:
            _current = None
        with self.watchdog.phase(Phase.FINISH):
            self.checkpoints.close()
            if self.snapshots.replicas is not None:  # every rank ends the same exchange
                self.snapshots.replicas.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.watchdog.stop(barrier=True)
        self.preemption.uninstall()
        self._uninstall_excepthook()
        shutdown_distributed(self.ctx)

    # ------------------------------------------------------------------ guards and phases
    def guard(self) -> AbstractContextManager[None]:
        """Any exception in the block takes every rank down together with one exit code
        (ExitCode.OOM, RANK_EXCEPTION or PEER_LOST) instead of leaving peers hanging."""
        return self.guards.guard()

    def micro_batches(
        self, *tensors: torch.Tensor, model: nn.Module | None = None, split: int | None = None
    ) -> Iterator[MicroBatch]:
        """Split a batch into micro-batches; with DDP an OOM on any rank retries the same
        batch in smaller ones on every rank (see resilient.guard.guard)."""
        self._fp.inputs(*tensors)  # the whole batch, whatever the split
        return self.guards.micro_batches(*tensors, model=model, split=split)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Run a block in phase `name` (e.g. "eval", "checkpoint") and its hang timeout."""
        return self.watchdog.phase(name)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
