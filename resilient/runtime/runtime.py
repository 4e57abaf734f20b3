"""The in-worker runtime: what `resilient.init()` returns.

It owns the process groups, the event log, the tracked training state, resuming from the
newest valid checkpoint, saving, and the coordinated stop on preemption. The loops between
(`steps()`, `epochs()`, the save policy) are in resilient/runtime/loops.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from resilient import events as ev
from resilient import log
from resilient.checkpoint import CheckpointConfig, TrainState, open_manager
from resilient.checkpoint.state import StatefulLike
from resilient.envvars import (  # re-exported
    ENV_CHECKPOINT_DIR,
    ENV_RUN_DIR,
    ENV_SCRATCH,
    parse_signals,
)
from resilient.errors import CheckpointError, ConfigError
from resilient.exitcodes import ExitCode
from resilient.runtime import hot
from resilient.runtime._ddp import ddp_modules, pin_buckets
from resilient.runtime.batches import ResumableBatches
from resilient.runtime.dist import (
    DistContext,
    abandon_distributed,
    env_identity,
    init_distributed,
    shutdown_distributed,
)
from resilient.runtime.elastic import DataPosition
from resilient.runtime.errorfile import install_excepthook
from resilient.runtime.fingerprint import ReplayCheck, StepFingerprints
from resilient.runtime.guard import Guard, MicroBatch
from resilient.runtime.heartbeat import Phase, WatchdogConfig
from resilient.runtime.loader_workers import shield_workers
from resilient.runtime.loops import Loops
from resilient.runtime.preempt import PreemptConfig, Preempted, PreemptionWatch
from resilient.runtime.progress import ProgressLog
from resilient.runtime.replica import BuddyReplicas
from resilient.runtime.snapshot import SnapshotConfig, Snapshots
from resilient.runtime.watchdog import Watchdog, exit_now

__all__ = [
    "ENV_CHECKPOINT_DIR",
    "ENV_RUN_DIR",
    "ENV_SCRATCH",
    "Runtime",
    "RuntimeConfig",
    "current",
    "init",
]


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the runtime saves and logs. Checkpoint storage details live in `checkpoint`."""

    checkpoint: CheckpointConfig
    """Where checkpoints go and how they are written."""
    run_dir: str | None = None
    """Per-rank JSON event logs go to <run_dir>/logs. Default: $RESILIENT_RUN_DIR, else
    ./runs/<run id>."""
    save_every_steps: int | None = 100
    """Save after every N completed steps; None to save on time only."""
    save_every_seconds: float | None = None
    """Save when this many seconds passed since the last save (decided by rank 0 for all)."""
    save_at_end: bool = True
    """Save (synchronously) when `steps()` reaches `total`."""
    backend: str | None = None
    """Training process-group backend; default gloo on CPU, cpu:gloo,cuda:nccl on GPU."""
    pg_timeout_s: float = 1800.0
    """Collective timeout of the training group."""
    side_timeout_s: float = 300.0
    """Collective timeout of the control and checkpoint groups."""
    console_level: str = "INFO"
    """Lowest level shown on the console; the JSON log keeps everything."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig.from_env)
    """Hang detection, heartbeats, barrier and OOM-guard settings; init() also takes a dict
    of its fields. Default: WatchdogConfig defaults with $RESILIENT_WATCHDOG overrides."""
    preempt: PreemptConfig = field(default_factory=PreemptConfig.from_env)
    """Preemption signals, grace period and check interval (resilient.runtime.preempt); init()
    also takes a dict. Default: $RESILIENT_GRACE_S and $RESILIENT_PREEMPT_SIGNALS, which
    `resilient run` sets, else 30 s and SIGTERM,SIGUSR1."""
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig.from_env)
    """In-memory snapshots and in-place rollback on an agreed exception (off by default;
    resilient.runtime.snapshot); init() also takes a dict. Default: $RESILIENT_SNAPSHOT."""
    pin_ddp_buckets: bool = True
    """Fix a tracked DDP model's gradient buckets at track(), in parameter order, so every
    process, fresh or resumed, all-reduces with the same layout from its first step. Without
    it DDP reduces a process's first step in one bucket and later ones in buckets rebuilt in
    gradient-ready order, so on 3 or more ranks the step after a resume sums in another order
    and the run is no longer bit-exact. False keeps DDP's own layout: more communication
    overlaps the backward pass on large models (resilient.runtime._ddp)."""

    def __post_init__(self) -> None:
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ConfigError(f"save_every_steps must be >= 1 or None, got {self.save_every_steps}")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ConfigError(
                f"save_every_seconds must be > 0 or None, got {self.save_every_seconds}"
            )
        if self.side_timeout_s <= 0 or self.pg_timeout_s <= 0:
            raise ConfigError("pg_timeout_s and side_timeout_s must be > 0 seconds")
        if self.console_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ConfigError(
                f"console_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, "
                f"got {self.console_level!r}"
            )


_RUNTIME_FIELDS = {f.name for f in dataclasses.fields(RuntimeConfig)} - {"checkpoint"}
_CKPT_FIELDS = {f.name for f in dataclasses.fields(CheckpointConfig)} - {"url"}


def init(checkpoint_dir: str | os.PathLike[str] | None = None, **options: Any) -> Runtime:
    """Join the process group launched by torchrun and return the Runtime.

    `checkpoint_dir` is a local directory or fsspec URL (default $RESILIENT_CHECKPOINT_DIR,
    else ./checkpoints). `options` are fields of RuntimeConfig or CheckpointConfig, e.g.
    `save_every_steps=50, keep_last=2, async_save=False`. Raises ConfigError on an unknown
    option or a value out of range. Waits up to `pg_timeout_s` for the other ranks.
    """
    unknown = set(options) - _RUNTIME_FIELDS - _CKPT_FIELDS
    if unknown:
        raise ConfigError(
            f"unknown option(s) {sorted(unknown)}; valid options are "
            f"{sorted(_RUNTIME_FIELDS | _CKPT_FIELDS)}"
        )
    url = (
        os.fspath(checkpoint_dir)
        if checkpoint_dir is not None
        else (os.environ.get(ENV_CHECKPOINT_DIR) or "checkpoints")
    )
    scratch = os.environ.get(ENV_SCRATCH)
    if scratch:  # resilient check-resume: never the script's own locations
        url, options["run_dir"] = os.path.join(scratch, "ckpt"), os.path.join(scratch, "run")
        options.pop("local_url", None)
    ckpt = CheckpointConfig(url=url, **{k: v for k, v in options.items() if k in _CKPT_FIELDS})
    if isinstance(options.get("watchdog"), dict):
        options["watchdog"] = WatchdogConfig.from_env(options["watchdog"])
    if isinstance(options.get("preempt"), dict):
        options["preempt"] = PreemptConfig.from_env(options["preempt"])
    if isinstance(options.get("snapshot"), dict):
        options["snapshot"] = SnapshotConfig.from_env(options["snapshot"])
    cfg = RuntimeConfig(
        checkpoint=ckpt, **{k: v for k, v in options.items() if k in _RUNTIME_FIELDS}
    )
    return Runtime(cfg)


_current: Runtime | None = None


def current() -> Runtime:
    """The Runtime that init() returned in this process (for code that cannot be handed it,
    e.g. a Trainer class built after init()). Raises RuntimeError before init() or after
    close()."""
    if _current is None:
        raise RuntimeError("no resilient Runtime in this process: call resilient.init() first")
    return _current


def _at_least_warning(level: str) -> str:
    order = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    return order[max(order.index(level.upper()), 2)]


def _roll_call(config: RuntimeConfig) -> Callable[[Any, int, int], None] | None:
    """Generation >= 1 of hot recovery: every rank waits for the others before the groups
    form, and names one that does not come (hot.roll_call)."""
    if not (hot.enabled() and hot.generation() >= 1):
        return None
    return lambda store, rank, world: hot.roll_call(store, rank, world, config.watchdog)


class Runtime(Loops):
    """Resumable, checkpointed training around a user's loop. Create it with `init()`."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        # the log first: what happens while the process group forms is logged there too
        rank, restart, run_id = env_identity()
        run_dir = config.run_dir or os.environ.get(ENV_RUN_DIR) or os.path.join("runs", run_id)
        self.run_dir = os.path.abspath(run_dir)
        self.log_path = log.configure(
            run_dir=self.run_dir,
            run_id=run_id,
            rank=rank,
            restart=restart,
            # one voice on the console: other ranks show only warnings and errors
            console_level=config.console_level
            if rank == 0
            else _at_least_warning(config.console_level),
        )
        self.ctx: DistContext = init_distributed(
            backend=config.backend,
            timeout_s=config.pg_timeout_s,
            side_timeout_s=config.side_timeout_s,
            store=hot.carried_store(),
            before_group=_roll_call(config),
        )
        self.log = log.get_logger()
        self.state = TrainState()
        # one tier, or local + remote when config.checkpoint.local_url is set
        self.checkpoints = open_manager(config.checkpoint, process_group=self.ctx.checkpoint_group)
        self.step = 0
        """Steps completed so far (the step a checkpoint taken now would carry)."""
        self._batches: ResumableBatches | None = None
        self._resumed = False
        self._last_save_time = time.monotonic()
        self._hooks: list[Any] = []
        self._progress = ProgressLog(self.log)
        # resilient watchdog + guard: heartbeats, hang monitor, OOM/exception agreement
        self.watchdog = Watchdog(config.watchdog, self.ctx, self.run_dir)
        self.watchdog.start()
        self.guards = Guard(self.watchdog, self.ctx, self.run_dir)
        self.guards.resume_split()
        # resilient: in-memory snapshots; the guard may agree on a rollback (runtime/snapshot.py)
        snap = config.snapshot
        if hot.enabled() and self.ctx.distributed and not snap.enabled:
            snap = dataclasses.replace(snap, enabled=True)  # hot recovery restores from them
        self.snapshots = Snapshots(snap, self.ctx)
        if self.snapshots.enabled:
            self.guards.rollback = self.snapshots.agree_rollback
        self._abandoned = False
        self.lost_save: int | None = None
        """After abandon(): the step of a save started here that did not commit (its write
        lost the peer), for the hot resume's catch-up save."""
        if hot.enabled() and self.ctx.distributed and self.ctx.base_store is not None:
            # a lost peer: re-run the script in place from the snapshots (runtime/hot.py)
            if snap.replicas:  # snapshots also go to a buddy (runtime/replica.py)
                self.snapshots.replicas = BuddyReplicas(self.ctx, timeout_s=config.side_timeout_s)
            else:  # the per-rank part (a few KiB) through the launcher's store
                store = self.ctx.base_store
                self.snapshots.replicate = lambda held: hot.put_replica(store, self.rank, held)
            self.guards.hot = lambda exc: hot.restart(self, exc)
            self.guards.hot_own = lambda exc, kind, split: hot.leave_for_replacement(
                self, exc, kind=kind, split=split
            )
        # resilient preemption: signals become a stop at an agreed step (runtime/preempt.py)
        self.preemption = PreemptionWatch(
            config.preempt,
            group=self.ctx.control_group,
            distributed=self.ctx.distributed,
            leave_now=lambda: self.guards.failing,
        )
        self.guards.stop_requested = lambda: self.preemption.requested
        self._uninstall_excepthook = install_excepthook(
            lambda: self.step, divert=self.guards.on_uncaught
        )
        self._data: DataPosition | None = None
        self._fp = StepFingerprints(self.log, world=self.ctx.world_size)
        self._init_loops()  # resilient/runtime/loops.py
        global _current
        _current = self
        self.log.info(
            ev.RUNTIME_INIT,
            world_size=self.ctx.world_size,
            generation=hot.generation(),
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
        **extras: StatefulLike,
    ) -> None:
        """Register what a checkpoint holds. Call once, before `steps()`.

        `loader` should be a torchdata StatefulDataLoader; iterate it through `batches()`
        so its position and epoch are checkpointed. `global_batch_size` (default: the loader's
        batch_size x world size at the first start) is kept on other world sizes through
        `grad_accum` micro-batches per step. `extras` are objects with
        state_dict()/load_state_dict() that are identical on every rank (a GradScaler, ...).
        With a DDP `model` (and `pin_ddp_buckets`, the default) it fixes DDP's gradient
        buckets, a collective on DDP's process group: every rank calls track(), before the
        first training forward.
        """
        if self._resumed:
            raise RuntimeError("track() must be called before steps() starts")
        if optimizer is not None and model is None:
            raise ConfigError(
                "track(optimizer=...) needs model=... too (optimizer state is "
                "saved by parameter name)"
            )
        common: dict[str, StatefulLike] = dict(extras)
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
            # its workers must outlive a preemption signal until the agreed stop
            shield_workers(loader, parse_signals(",".join(self.config.preempt.signals)))
            per_rank["loader"] = self._batches
            # world-size-independent position + global batch, for elastic resume
            self._data = DataPosition(
                self._batches, world_size=self.world_size, global_batch_size=global_batch_size
            )
            common["__data__"] = self._data
        self.state = TrainState(model=model, optimizer=optimizer, common=common, per_rank=per_rank)
        self.snapshots.track(self.state)  # ConfigError when two copies do not fit in memory
        if model is not None and self.config.pin_ddp_buckets:
            for ddp in ddp_modules(model):
                outcome = pin_buckets(ddp)
                if outcome in ("pinned", "never_rebuilt"):
                    self.log.info("ddp.buckets", outcome=outcome)
                else:  # exact resume on 3+ ranks is then up to the script
                    self.log.warning(
                        "ddp.buckets",
                        outcome=outcome,
                        note="bucket layout not fixed: on 3+ ranks the first step after a "
                        "resume may sum gradients in another order (call track() before "
                        "the first forward)",
                    )
        self._install_fences(model, optimizer)
        self._hooks += self.watchdog.instrument(model, optimizer)  # phases for hang reports
        if model is not None:  # each step's first forward inputs: its fingerprint
            self._hooks.append(self._fp.attach(model))

    def _install_fences(self, model: nn.Module | None, optimizer: Any) -> None:
        # An async save copies tensors in the background; nothing may change them until the
        # copy is done (pytorch#144657). Parameters and optimizer state change in step();
        # buffers (BatchNorm statistics, DDP's buffer broadcast) change in forward().
        for h in self._hooks:
            h.remove()
        self._hooks = []
        fence = self.checkpoints.wait_staged
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: fence()))
        if model is not None and any(True for _ in model.buffers()):
            self._hooks.append(model.register_forward_pre_hook(lambda *_: fence()))

    # ------------------------------------------------------------------ the loop
    def resume(self) -> int:
        """Load the newest valid checkpoint, if any, and return the step to continue from.

        Raises StorageError if the checkpoint location is not writable and
        CheckpointMismatchError if its checkpoints belong to another model.
        """
        if not self._resumed:
            self.checkpoints.check_writable()
            loaded = None
            from_memory = None
            if hot.enabled() and hot.generation() > 0 and self.ctx.distributed:
                with self.watchdog.phase(Phase.CHECKPOINT):
                    from_memory = hot.resume(self)  # None: no step every rank can restore
            if from_memory is not None:
                self._resume_hot(from_memory.step, catch_up=from_memory.catch_up)
                return self.step
            with self.watchdog.phase(Phase.CHECKPOINT):
                loaded = self.checkpoints.load_latest(self.state)
            self.step = loaded or 0
            self._saved_step = loaded
            if self._data is not None:
                self._data.apply()  # elastic: reposition the loader on a new world size
            self._resumed = True
            self._last_save_time = time.monotonic()
            self.log.info(ev.RUNTIME_RESUME, step=self.step, from_checkpoint=loaded is not None)
            if loaded is not None:  # the steps run again are compared with the earlier ones
                self._fp.check = ReplayCheck.open(
                    self.log,
                    self.log_path,
                    rank=self.rank,
                    world=self.world_size,
                    resumed_at=loaded,
                )
        return self.step

    def _resume_hot(self, step: int, *, catch_up: bool) -> None:
        """After hot.resume() restored `step` from memory: what a load would have set up.
        `catch_up`: a rank's durable save was lost with the peer; save `step` at once (every
        rank: the hot resume agreed on it), so the newest checkpoint does not fall one
        interval further behind with each hot recovery."""
        self.step = step
        self._saved_step = None
        if self._data is not None:
            self._data.apply()
        self._resumed = True
        self._last_save_time = time.monotonic()
        self.log.info(ev.RUNTIME_RESUME, step=step, from_checkpoint=False, hot=True)
        # the steps run again are compared with the ones the lost generation logged
        self._fp.check = ReplayCheck.open(
            self.log, self.log_path, rank=self.rank, world=self.world_size, resumed_at=step
        )
        if catch_up:
            self.save()

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
        self.watchdog.stop(barrier=False)
        self.preemption.uninstall()
        self._uninstall_excepthook()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        drained = threading.Event()

        def drain() -> None:
            with contextlib.suppress(BaseException):  # a save that lost the peer fails
                self.checkpoints.wait()
            drained.set()

        threading.Thread(target=drain, name="resilient-drain", daemon=True).start()
        if not drained.wait(drain_s):
            return False
        # the replica exchange in flight fails at once on a lost peer; its group must not be
        # destroyed under it
        replicas = self.snapshots.replicas
        if replicas is not None and not replicas.wait(drain_s):
            return False
        if self._saved_step is not None and self.checkpoints.last_committed != self._saved_step:
            self.lost_save = self._saved_step
        with contextlib.suppress(BaseException):
            self.checkpoints.close()
        abandon_distributed(self.ctx)
        return True

    def save(self, *, blocking: bool | None = None) -> None:
        """Checkpoint the tracked state at the current step (async unless configured)."""
        self._last_save_time = time.monotonic()
        self._saved_step = self.step
        sync = blocking if blocking is not None else not self.config.checkpoint.async_save
        t0 = time.perf_counter()
        with self.watchdog.phase(Phase.CHECKPOINT):
            self.checkpoints.save(self.state, self.step, blocking=blocking)
        if sync:  # what a final save on preemption will take
            self.preemption.note_save(time.perf_counter() - t0)

    # ------------------------------------------------------------------ preemption, elastic
    def _check_preempt(self, resumed_at: int, *, force: bool = False) -> None:
        """Agree across ranks whether a preemption signal arrived; if so, stop (never returns).
        A collective on the control group when due (or `force`): every rank calls it alike."""
        try:
            with self.watchdog.phase(Phase.AGREE):
                stop = self.preemption.agree(force=force)
        except (RuntimeError, dist.DistError) as e:  # a peer died during the agreement
            if self.preemption.requested:  # leaving anyway; the group cannot save now
                exit_now(ExitCode.PEER_LOST, kind="preempt_group_lost", error=str(e)[:300])
            self.guards.fail_fast(e)
        if stop:
            self._stop_preempted(resumed_at)

    def _stop_preempted(self, resumed_at: int) -> NoReturn:
        """Every rank agreed to stop before the next step: finish or make the final save within
        the grace period, leave the process groups, raise Preempted (exit ExitCode.PREEMPTED).
        `resumed_at` is the step this attempt started from: with no step done since, there is
        nothing new to save."""
        watch, log, step, mgr = self.preemption, self.log, self.step, self.checkpoints
        log.warning(
            "preempt.stop",
            step=step,
            signal=watch.signal_name,
            signalled_here=watch.requested,
            since_signal_s=watch.since_signal_s(),
            remaining_s=round(watch.remaining_s(), 3),
        )
        try:
            with self.watchdog.phase(Phase.CHECKPOINT):
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
                        self.save(blocking=True)
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
        self.close()
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

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step that keep the global batch on this world size
        (1 unless the run resumed on fewer ranks than it started with, or track() got a
        global_batch_size). Read it inside the loop: it is known once steps() resumed."""
        if not self._resumed:
            self.resume()
        return self._data.grad_accum if self._data is not None else 1

    @property
    def global_batch_size(self) -> int | None:
        return self._data.global_batch if self._data is not None else None

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
        batch in smaller ones on every rank (see resilient.runtime.guard)."""
        self._fp.inputs(*tensors)  # the whole batch, whatever the split
        return self.guards.micro_batches(*tensors, model=model, split=split)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Run a block in phase `name` (e.g. "eval", "checkpoint") and its hang timeout."""
        return self.watchdog.phase(name)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
