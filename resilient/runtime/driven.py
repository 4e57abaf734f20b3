"""A training loop that a framework runs (the Hugging Face Trainer, Lightning): the same step
accounting as `rt.steps()`, driven from the framework's hooks instead of a generator.

`rt.steps()` owns the loop: it asks for a preemption stop, opens a step, yields, closes it
and saves on its policy. A framework owns its own loop, so its adapter calls the same pieces
at the framework's seams: `start()` once the state is tracked, `begin()` before the step's
first batch is fetched (so a stop agreed there saves the data position without it),
`end()` after the optimizer step, `save()` where the framework decides to save, and
`finish()` (or `abort()`) when the framework's loop ends. The adapters live in
resilient/integrations/; the core never imports them.

What `steps()` can do and a driven loop cannot: roll a numerical fault back in place (the
framework's loop cannot be rewound). A fault that would roll back takes the cold path
instead: a restart from the newest checkpoint, then ExitCode.NUMERICAL_FAULT when it
persists (docs/integrations.md#what-differs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resilient import events as ev
from resilient.data.seeded import SeededSamples
from resilient.errors import ConfigError
from resilient.hang.phases import Phase
from resilient.runtime.loops import _env_stop

if TYPE_CHECKING:
    from resilient.data.batches import ResumableBatches
    from resilient.runtime.runtime import Runtime

__all__ = ["DrivenLoop"]


class DrivenLoop:
    """One run of a framework's training loop over `total` optimizer steps."""

    def __init__(self, rt: Runtime, total: int) -> None:
        if total < 0:
            raise ConfigError(f"total must be >= 0, got {total}")
        self.rt = rt
        self.total = total
        forced = _env_stop()  # `resilient check-resume` stops a run halfway
        self.end_at = total if forced is None else min(total, forced)
        self.start_step = 0
        self._started = False
        self._done = False

    def start(self) -> int:
        """Resume from the newest checkpoint (or a hot peer's snapshot) and return the step
        the framework continues from. The framework saves (`save()`), not a policy here."""
        rt = self.rt
        rt._set_policy(None, None, None)
        self.start_step = rt._enter_loop()
        self._started = True
        rt.log.info(ev.TRAIN_LOOP, start=self.start_step, total=self.end_at, driven=True)
        rt.snapshots.after_step(self.start_step, force=True)
        rt.snapshots.keep_at_opening()  # where the framework saves, after its epoch's end
        return self.start_step

    @property
    def batches(self) -> ResumableBatches | None:
        """The tracked loader's epochs and position (None without track(loader=...))."""
        return self.rt._batches

    def enter_epoch(self, epoch: int, framework: str) -> ResumableBatches:
        """Before the framework iterates its epoch `epoch` of the tracked loader: leave the
        last epoch if it ended (or was cut short), check that the loader is at this one (a
        RuntimeError naming `framework` otherwise: the resumed position was not applied),
        and tell a SeededSamples dataset the epoch. Returns the loader's batches."""
        b = self.rt._batches
        if b is None:
            raise RuntimeError(f"{framework} iterated the training loader before it was tracked")
        if b.epoch < epoch:
            b.end_epoch()
        if b.epoch != epoch:
            raise RuntimeError(
                f"{framework}'s epoch {epoch} is not the loader's {b.epoch}: the resumed "
                "position was not applied; this run would not be exact"
            )
        data = getattr(b.loader, "dataset", None)
        if isinstance(data, SeededSamples):
            data.set_epoch(epoch)
        return b

    def next_batch(self) -> Any:
        """The current epoch's next batch, in phase `data`; StopIteration at its end."""
        if self.rt._batches is None:
            raise RuntimeError("next_batch() needs track(loader=...) first")
        self.rt.watchdog.progress.enter(Phase.DATA)
        return self.rt._batches.next_in_epoch()

    @property
    def stopping(self) -> bool:
        """`resilient check-resume` asked for a stop at this step: the framework should end
        its loop (the final save follows in finish())."""
        return self.rt.step >= self.end_at

    def begin(self) -> None:
        """Before the step's first batch: the last step's snapshot (when one is due), then a
        preemption stop agreed here saves and leaves the process (ExitCode.PREEMPTED);
        otherwise the step opens (heartbeats, fingerprints)."""
        rt = self.rt
        rt.snapshots.opening()
        rt._check_preempt(self.start_step)
        rt._progress.begin()
        rt._open_step(rt.step)

    def end(self) -> None:
        """After the step's optimizer step: count it (the run's step becomes the number of
        steps done), check it for numerical faults, keep a snapshot if they are on."""
        rt = self.rt
        if rt._open is None:
            return
        rt._numeric_check(can_roll_back=False)
        rt._close_step(None)

    def save(self) -> None:
        """Checkpoint the state now (async unless configured), once per step."""
        rt = self.rt
        if rt._saved_step != rt.step:
            rt.save()

    def finish(self) -> None:
        """The framework's loop ended: the final save (synchronous; skipped when this step
        is saved already), the final digest, and the wait for saves in flight."""
        if self._done or not self._started:
            return
        self._done = True
        rt = self.rt
        try:
            self.end()
            rt._finish_loop(self.start_step)
        finally:
            rt._leave_loop()
        rt.log.info(ev.RUNTIME_DONE, step=rt.step, total=self.total)

    def abort(self) -> None:
        """The framework's loop raised: wait for a save in flight, save nothing more."""
        if self._done or not self._started:
            return
        self._done = True
        self.rt._leave_loop()
