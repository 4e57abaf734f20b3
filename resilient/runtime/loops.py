"""The training loops of the Runtime: `steps()` and `epochs()`, one step's accounting, the
save policy, and the loop's end (the final save, the final digest).

`Loops` is a part of `Runtime` (resilient/runtime/runtime.py), kept apart so each file holds
one concept: runtime.py sets up and tears down (process groups, tracking, resume, saves,
preemption), this file runs the loop between. A step opens when its body is handed a step
number (steps()) or a batch (rt.batches() inside epochs()), and closes when the loop is asked
for the next one: then it is counted (train.progress, step.fingerprint), and saved if due.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from resilient import events as ev
from resilient.checkpoint import TrainState, state_digest
from resilient.data.batches import ResumableBatches
from resilient.envvars import ENV_FINAL_DIGEST, ENV_STOP_AT
from resilient.errors import ConfigError
from resilient.groups.groups import DistContext
from resilient.guard.guard import Guard
from resilient.hang.phases import Phase, Progress
from resilient.hang.watchdog import Watchdog
from resilient.hot.recovery import HotRecovery
from resilient.memory.snapshot import Snapshots, StepCounter
from resilient.numeric.detect import NumericWatch
from resilient.preempt.watch import PreemptionWatch
from resilient.replay.fingerprint import ReplayCheck, StepFingerprints
from resilient.runtime.numeric import NumericResponse
from resilient.runtime.progress import ProgressLog

if TYPE_CHECKING:
    from resilient.checkpoint import CheckpointStore
    from resilient.runtime.config import RuntimeConfig

__all__ = ["Loops"]

_KEEP: Any = object()
"""A save policy argument not given: keep init()'s."""


class Loops:
    """The loop half of Runtime (a mixin: Runtime sets these attributes up)."""

    config: RuntimeConfig
    ctx: DistContext
    log: Any
    state: TrainState
    checkpoints: CheckpointStore
    watchdog: Watchdog
    preemption: PreemptionWatch
    snapshots: Snapshots
    guards: Guard
    hot: HotRecovery | None
    step: int
    _batches: ResumableBatches | None
    _progress: ProgressLog
    _fp: StepFingerprints
    numeric: NumericWatch
    _numeric: NumericResponse
    _last_save_time: float

    def _init_loops(self) -> None:
        self._open: int | None = None
        """The step whose body runs now (None between steps)."""
        self._saved_step: int | None = None
        """The step of the newest save started or loaded (never two at one step)."""
        self._every_steps = self.config.save_every_steps
        self._every_seconds = self.config.save_every_seconds
        self._epoch_loop: _EpochLoop | None = None
        self._mark_stepped = self.hot is not None and self.hot.rejoining and self.ctx.rank == 0
        """Rank 0 of a hot generation: tell the agent when the first step closed."""

    if TYPE_CHECKING:  # Runtime's

        def resume(self) -> int: ...

        _data: Any
        _resumed: bool
        log_path: Any

        @property
        def rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        def save(self, *, blocking: bool | None = None) -> None: ...

        def _check_preempt(self, resumed_at: int, *, force: bool = False) -> None: ...

    def batches(self) -> Iterator[Any]:
        """Inside `epochs()`: the rest of the current epoch, one step per batch. Elsewhere: an
        endless iterator over the tracked loader, across epochs, resuming mid-epoch (use it
        with `steps()`)."""
        if self._batches is None:
            raise RuntimeError("batches() needs track(loader=...) first")
        if self._epoch_loop is not None:
            self._epoch_loop.iterated = True
            return self._epoch_loop
        return _DataPhase(self._batches, self.watchdog)

    def steps(
        self,
        total: int,
        *,
        stop_at: int | None = None,
        save_every_steps: int | None = _KEEP,
        save_every_seconds: float | None = _KEEP,
    ) -> Iterator[int]:
        """Yield step numbers from the resumed step up to `total` (exclusive). After each
        step's body finishes, saves when the policy says so: init()'s
        `save_every_steps`/`save_every_seconds`, or, when either is given here, these two
        (None: not on that count). At `total`, or at `stop_at` (leave early with a committed
        checkpoint, e.g. at the end of a time-sliced allocation), a synchronous save. Leaving
        the loop by break or exception waits for a save in flight but does not save.
        """
        if total < 0:
            raise ConfigError(f"total must be >= 0, got {total}")
        if stop_at is not None and not 0 <= stop_at <= total:
            raise ConfigError(f"stop_at must be in [0, total={total}], got {stop_at}")
        self._set_policy(save_every_steps, save_every_seconds, None)
        end = total if stop_at is None else stop_at
        forced = _env_stop()  # `resilient check-resume` stops a run halfway
        end = end if forced is None else min(end, forced)
        start = self._enter_loop()
        self.log.info(ev.TRAIN_LOOP, start=start, total=end)  # the live status's ETA
        counter = StepCounter(start, end)  # a rollback rewinds it
        self.snapshots.after_step(start, force=True)
        try:
            for step in counter:
                self._check_preempt(start)  # may end the run with ExitCode.PREEMPTED
                self._progress.begin()
                self._open_step(step)
                yield step
                self._numeric_check(can_roll_back=self.guards.rollback is not None)
                if self.snapshots.pending is None:  # a sampled step runs twice (numeric)
                    self._numeric.rerun(step)
                if self.snapshots.pending is not None:  # agreed: every rank
                    self._open = None
                    self._progress.flush()  # the replayed steps start a new window
                    self.step = self.snapshots.roll_back()
                    counter.rewind(self.step)
                    continue
                self._close_step(end)
            self._finish_loop(start)
        finally:
            self._leave_loop()
        self.log.info(ev.RUNTIME_DONE, step=self.step, total=total)

    def epochs(
        self,
        n: int,
        *,
        save_every_epochs: int | None = None,
        save_every_steps: int | None = _KEEP,
        save_every_seconds: float | None = _KEEP,
    ) -> Iterator[int]:
        """Yield epoch numbers from the resumed epoch up to `n` (exclusive); inside, iterate
        `rt.batches()`: the rest of this epoch's batches of the tracked loader, each one a
        step (resumed mid-epoch where the checkpoint was taken).

            for epoch in rt.epochs(90, save_every_epochs=1):
                for x, y in rt.batches():
                    ...

        The save policy: after every `save_every_epochs` epochs and/or on the step counts
        (see `steps()`); with none given, init()'s. A synchronous save at the end. Per-epoch
        code that changes state (a scheduler stepped per epoch, an evaluation that draws
        random numbers) belongs after the inner loop: code before it runs again when a
        resume lands inside the epoch.
        """
        if n < 0:
            raise ConfigError(f"n must be >= 0 epochs, got {n}")
        if self._batches is None:
            raise ConfigError("epochs() needs track(loader=...): the epoch is the loader's")
        if save_every_epochs is not None and save_every_epochs < 1:
            raise ConfigError(f"save_every_epochs must be >= 1 or None, got {save_every_epochs}")
        self._set_policy(save_every_steps, save_every_seconds, save_every_epochs)
        batches = self._batches
        start = self._enter_loop()
        loop = self._epoch_loop = _EpochLoop(self, start, _env_stop())
        # Nothing here rewinds the user's inner loop over rt.batches(), so an agreed failure
        # takes the cold path (a restart from the checkpoint) rather than a rollback.
        rollback, self.guards.rollback = self.guards.rollback, None
        try:
            while batches.epoch < n and not loop.stopped:
                epoch = loop.epoch = batches.epoch
                loop.iterated = False
                yield epoch
                self._close_step(None)  # the inner loop was left by a break
                if loop.stopped:
                    break
                if batches.epoch == epoch:
                    if not loop.iterated:
                        raise ConfigError(
                            "an epoch of rt.epochs() ended without iterating rt.batches(): "
                            "iterate it (not the loader itself), so each batch is a step "
                            "and the loader's position is checkpointed"
                        )
                    batches.end_epoch()  # broke out early: the next epoch starts fresh
                every = save_every_epochs
                last = batches.epoch >= n and self.config.save_at_end
                due = bool(every) and batches.epoch % (every or 1) == 0
                if due and not last and self.step != self._saved_step:
                    self.save()
            self._finish_loop(start)
        finally:
            self._epoch_loop = None
            self.guards.rollback = rollback
            self._leave_loop()
        self.log.info(ev.RUNTIME_DONE, step=self.step, epoch=batches.epoch, total_epochs=n)

    # the pieces both loops share
    def _resumed_at(self, step: int, *, loaded: int | None, hot: bool) -> None:
        """What a resume sets up, from a checkpoint (`loaded`), from memory (`hot`) or from
        nothing: the steps run again are compared with the ones logged before."""
        self.step, self._saved_step = step, loaded
        if self._data is not None:
            self._data.apply()  # elastic: reposition the loader on a new world size
        self._resumed = True
        self._last_save_time = time.monotonic()
        from_checkpoint = loaded is not None
        self.log.info(
            ev.RUNTIME_RESUME,
            step=step,
            from_checkpoint=from_checkpoint,
            **({"hot": True} if hot else {}),
        )
        if from_checkpoint or hot:
            self._fp.check = ReplayCheck.open(
                self.log, self.log_path, rank=self.rank, shape=self._fp.shape, resumed_at=step
            )

    def _enter_loop(self) -> int:
        # preemption signals are ours only while the loop can act on them (preempt/watch.py)
        self.preemption.install()
        try:
            return self.resume()
        except BaseException:
            self.preemption.uninstall()
            raise

    def _open_step(self, step: int) -> None:
        self.watchdog.step_begin(step)
        self._fp.begin(step)
        self.numeric.begin(step)
        self._open = step

    def _numeric_check(self, *, can_roll_back: bool) -> None:
        """The open step's agreed numerical fault, if any, acted on (numeric/respond.py):
        a rollback is left pending for the loop, a skip goes on, the rest leave the process."""
        fault = self.numeric.end_step()
        if fault is not None:
            self._numeric.act(fault, can_roll_back=can_roll_back)

    def _close_step(self, end: int | None) -> None:
        """The open step's body finished: account for it, then save if the policy says so."""
        if self._open is not None:  # epochs() checks here; steps() did before its rollback
            self._numeric_check(can_roll_back=False)
        step, self._open = self._open, None
        if step is None:
            return
        self._numeric.closed(step)
        self._progress.end(step)  # train.progress: what `resilient report` reads
        self._fp.end(step)  # step.fingerprint, and the replay check after a resume
        if self._data is not None and self._epoch_loop is None:  # steps(): data.accum_ignored
            self._data.step_end(step)  # when it took fewer batches than rt.grad_accum
        self.step = step + 1
        self.watchdog.step_end(self.step)  # tightens timeouts; barrier every N
        saved = (end is None or self.step < end) and self._should_save()
        if saved:
            self.save()  # checks the replicas first (sdc)
        elif self._numeric.replicas_due(self.step):
            self._numeric.check_replicas(self.step)
        if self.guards.rollback is not None:  # off in epochs(): a copy nothing could use
            force = saved or self._numeric.rerun_due(self.step)  # a re-run starts there
            self.snapshots.after_step(self.step, force=force)
        if self._mark_stepped:  # the agent starts its next spare then (supervisor/hot.py)
            self._mark_stepped = False
            assert self.hot is not None
            self.hot.mark_stepped()

    def _finish_loop(self, start: int) -> None:
        if self.step > start or self._open is not None:
            # Agreements are spread over steps (PreemptConfig.check_interval_s): a signal
            # since the last one must still stop the run as a preemption, so the final
            # save keeps to the grace period and the exit code says "preempted".
            self._check_preempt(start, force=True)
            if self.config.save_at_end and self.step != self._saved_step:
                self.save(blocking=True)
        if os.environ.get(ENV_FINAL_DIGEST) and self.state.model is not None:
            digest = state_digest(self.state.model, self.state.optimizer)
            self.log.info(ev.RUNTIME_DIGEST, step=self.step, digest=digest)

    def _leave_loop(self) -> None:
        self.preemption.uninstall()
        self._open = None
        self._progress.flush()
        self._fp.flush()
        if self._fp.check is not None:
            self._fp.check.finish()
        self.watchdog.progress.enter(Phase.FINISH)
        self.checkpoints.wait()

    def _set_policy(self, every_steps: Any, every_seconds: Any, every_epochs: int | None) -> None:
        policy = _save_policy(self.config, every_steps, every_seconds, every_epochs)
        self._every_steps, self._every_seconds = policy

    def observe(self, *, loss: Any = None, grad_norm: Any = None) -> None:
        """Hand over this step's loss (a tensor or a number; summed over several calls in a
        step) for its fingerprint, so a resume also checks that replayed steps reach the same
        loss. On GPU it is read back later, without waiting for the device.
        `grad_norm`: the total norm of all the gradients the optimizer steps on, when the
        loop computes it anyway (`clip_grad_norm_`'s result, after the step's last
        backward): the non-finite check reads it instead of passing over the gradients."""
        if loss is not None:
            self._fp.observe_loss(loss)
            self.numeric.observe_loss(loss)
        if grad_norm is not None:
            self.numeric.observe_grad_norm(grad_norm)

    def saves_on_schedule(self, step: int) -> bool:
        """Whether the loop's step policy saves once `step` steps are done (the time policy
        is not a schedule a replay repeats)."""
        return self._every_steps is not None and step % self._every_steps == 0

    def _should_save(self) -> bool:
        every = self._every_steps
        due = every is not None and self.step % every == 0
        secs = self._every_seconds
        if secs is not None and not due:
            due = time.monotonic() - self._last_save_time >= secs
            if self.ctx.distributed:  # clocks differ: rank 0 decides for everyone
                box = [due]
                dist.broadcast_object_list(box, src=0, group=self.ctx.control_group)
                due = bool(box[0])
        return due


def _save_policy(
    config: RuntimeConfig, every_steps: Any, every_seconds: Any, every_epochs: int | None
) -> tuple[int | None, float | None]:
    """(save every N steps, every S seconds) of a loop: its own arguments, or init()'s when
    it gave none (Loops._set_policy)."""
    if every_steps is _KEEP and every_seconds is _KEEP and every_epochs is None:
        every_steps, every_seconds = config.save_every_steps, config.save_every_seconds
    every_steps = None if every_steps is _KEEP else every_steps
    every_seconds = None if every_seconds is _KEEP else every_seconds
    if every_steps is not None and every_steps < 1:
        raise ConfigError(f"save_every_steps must be >= 1 or None, got {every_steps}")
    if every_seconds is not None and every_seconds <= 0:
        raise ConfigError(f"save_every_seconds must be > 0 or None, got {every_seconds}")
    return every_steps, every_seconds


class _EpochLoop:
    """What `rt.batches()` returns inside `epochs()`: this epoch's batches, each one a step."""

    def __init__(self, rt: Loops, start: int, stop_at: int | None) -> None:
        self._rt = rt
        self._start = start
        self._stop_at = stop_at
        self.epoch = 0
        self.iterated = False
        self.stopped = False
        """The run reached `stop_at` ($RESILIENT_STOP_AT): the loops end with a save."""

    def __iter__(self) -> _EpochLoop:
        return self

    def __next__(self) -> Any:
        rt = self._rt
        rt._close_step(None)  # the previous batch's step: accounted for, saved if due
        batches = rt._batches
        if self.stopped or batches is None or batches.epoch != self.epoch:
            raise StopIteration
        if self._stop_at is not None and rt.step >= self._stop_at:
            self.stopped = True
            raise StopIteration
        # before the fetch: a stop saves the loader's position without this batch
        rt._check_preempt(self._start)
        rt._progress.begin()
        rt.watchdog.progress.enter(Phase.DATA)
        _one_off_fetch(batches, rt.watchdog.progress)
        batch = batches.next_in_epoch()  # StopIteration at the epoch's end
        rt._open_step(rt.step)
        return batch


def _env_stop() -> int | None:
    raw = os.environ.get(ENV_STOP_AT, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"${ENV_STOP_AT}={raw!r} is not a step number") from None
    if value < 0:
        raise ConfigError(f"${ENV_STOP_AT} must be >= 0, got {value}")
    return value


class _DataPhase:
    """The loader's iterator, in phase `data` while it fetches a batch."""

    def __init__(self, batches: ResumableBatches, watchdog: Watchdog) -> None:
        self._batches = batches
        self._progress = watchdog.progress

    def __iter__(self) -> _DataPhase:
        return self

    def __next__(self) -> Any:
        self._progress.enter(Phase.DATA)
        _one_off_fetch(self._batches, self._progress)
        return next(self._batches)


def _one_off_fetch(batches: ResumableBatches, progress: Progress) -> None:
    """An epoch's first fetch starts the loader's workers: a one-off, judged by the fixed
    timeout (hang/learned.py). So is the fetch that ends an epoch and starts the next."""
    try:
        size = len(batches.loader)
    except TypeError:  # an iterable dataset: no length, no telling
        size = -1
    if batches._it is None or batches._taken >= size >= 0:
        progress.one_off()
