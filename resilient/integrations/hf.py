"""The Hugging Face Trainer under the runtime, for one changed line:

    from resilient.integrations.hf import Trainer   # was: from transformers import Trainer

launched by `resilient run` (or torchrun) as before. The runtime then owns what a resume
needs, and the Trainer keeps everything else (its loop, logging, evaluation, callbacks):

- checkpoints: sharded DCP saves, async and atomic, where the Trainer would write a
  `checkpoint-N` directory (its `save_steps` or each epoch, and `save_total_limit`), in
  `$RESILIENT_CHECKPOINT_DIR` (`resilient run --checkpoint-url`) or `<output_dir>/resilient`;
- data: the training loader is a StatefulDataLoader over a StatefulDistributedSampler, so a
  resume continues the epoch where it stopped instead of replaying its batches, and each
  sample's randomness is seeded from (seed, epoch, index), loader workers included;
- state: model, optimizer, scheduler, every rank's RNG, TrainerState (global step, log
  history, callbacks' state) and the loss summed since the last log;
- faults: a preemption stops every rank at one agreed step (exit 85, nothing lost), a hang is
  named, an exception or OOM on one rank takes the others down with it, a non-finite loss
  restarts from the newest checkpoint and stops (exit 87) when it comes back, `--hot-recovery`
  replaces a lost rank in place.

`resilient_options` are `resilient.init()`'s options (a dict). What is exact and what is not:
docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import transformers
import transformers.trainer as hf_trainer

import resilient
from resilient.errors import ConfigError
from resilient.integrations._hf_parts import (
    EpochBatches,
    TrainerLossWindow,
    TrainerProgress,
    check_args,
    check_transformers,
    training_loader,
)
from resilient.runtime.driven import DrivenLoop

__all__ = ["Trainer"]

check_transformers()

_RESUMED = "<resilient: the loader is positioned already>"
"""What `_run_epoch` is told it resumes from: a marker, never a directory."""

_KEEP_ALL = 1_000_000
"""keep_last for save_total_limit=None (the Trainer then keeps every checkpoint)."""


class Trainer(transformers.Trainer):
    """`transformers.Trainer` whose checkpoints, data position and faults are the runtime's.
    Takes the Trainer's arguments, plus `resilient_options` (a dict of `resilient.init()`
    options). The runtime is `self.rt`."""

    def __init__(self, *args: Any, resilient_options: dict[str, Any] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        a = self.args
        opts = dict(resilient_options or {})
        url = opts.pop("checkpoint_dir", None) or os.environ.get(
            "RESILIENT_CHECKPOINT_DIR", os.path.join(a.output_dir or ".", "resilient")
        )
        opts.setdefault("keep_last", a.save_total_limit or _KEEP_ALL)
        opts["save_every_steps"] = None  # the Trainer decides when (its save_strategy)
        # the process group Accelerate made is adopted; the runtime adds its side groups
        self.rt = resilient.init(url, **opts)
        check_args(self, self.rt.log)
        if a.fsdp and not self.is_fsdp_enabled:  # Accelerate shards on accelerators only
            self.rt.log.warning(
                "hf.fsdp_not_enabled",
                reason="Accelerate enabled no FSDP plugin on this device: the model trains as DDP",
            )
        self._loop: DrivenLoop | None = None
        self._batches: EpochBatches | None = None
        self._resume_at: tuple[int, int] | None = None
        self.add_callback(_Steps(self))

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if self._batches is None:  # once: the runtime tracks this loader
            loader = training_loader(self, self.rt.rank, self.rt.world_size)
            self._batches = EpochBatches(loader)
        return self._batches

    get_train_dataloader.__resilient__ = True  # type: ignore[attr-defined]

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """As `Trainer.train`, resuming from the runtime's newest checkpoint by itself;
        `resume_from_checkpoint=True` changes nothing, a path is refused (see below)."""
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            raise ConfigError(
                f"resume_from_checkpoint={os.fspath(resume_from_checkpoint)!r}: this Trainer "
                "resumes from resilient's own checkpoints "
                f"({self.rt.config.checkpoint.url}) by itself, exactly; a Trainer "
                "checkpoint-N directory holds no loader position. Drop the argument, or start "
                "a new run from its weights with resilient_options={'init_from': "
                f"{os.fspath(resume_from_checkpoint)!r}}}"
            )
        if self._loop is not None:
            raise ConfigError("train() runs once per resilient Trainer: make a new one")
        try:
            return super().train(None, trial, ignore_keys_for_eval)
        except BaseException:
            if self._loop is not None:
                self._loop.abort()
            raise

    # -------------------------------------------------- the fenced seams (_hf_parts.SEAMS)
    def _begin_training(self) -> None:
        """At on_train_begin (model wrapped, optimizer and scheduler made): track the
        state, resume it, and tell the Trainer's loop where to continue."""
        assert self._batches is not None
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
        sched = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        extras: dict[str, Any] = {"hf_trainer": TrainerProgress(self)}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            extras["scaler"] = scaler
        self.rt.track(
            model=self.model_wrapped,
            optimizer=opt,
            scheduler=sched,
            loader=self._batches.loader,
            # the Trainer keeps the per-device batch: on another world size the global batch
            # follows it (one data.global_batch_changed event, old and new), no accumulation
            global_batch_size=self._train_batch_size * self.rt.world_size,
            **extras,
        )
        self.rt.state.per_rank["hf_loss_window"] = TrainerLossWindow(self)
        total = int(self.state.max_steps)  # as computed for this world size
        self._loop = DrivenLoop(self.rt, total)
        self._batches.loop = self._loop
        step = self._loop.start()
        if step and int(self.state.max_steps) != total:  # the saved TrainerState's differs
            why = (
                f"max_steps is {total} now: resume with max_steps={self.state.max_steps}, or "
                "start a new run in another checkpoint directory (init_from= its weights)"
                if self.args.max_steps > 0
                else "an epoch-based schedule (num_train_epochs, no max_steps) resumed on "
                "another number of ranks changes its length. Set max_steps, or resume on the "
                "saved number of ranks"
            )
            raise ConfigError(
                f"this run was saved with {self.state.max_steps} steps in all and now counts "
                f"{total} (its learning-rate schedule was built for the saved length): {why}"
            )
        if step != self.state.global_step:
            raise RuntimeError(
                f"resumed at step {step} but TrainerState says {self.state.global_step}: the "
                "checkpoint does not belong to this Trainer"
            )
        if step:
            self._resume_at = self._batches.position()
            self._initial_global_step = 0  # the run's totals, as an uninterrupted one logs

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        values = list(super().set_initial_training_values(args, dataloader))
        if args.max_steps > 0:
            # The epoch count bounds the Trainer's loop, and it is computed as if the run
            # started at step 0 on this world size: a run resumed on fewer ranks would end
            # its loop steps early. An upper bound instead; the loop stops at max_steps.
            values[0] = max(values[0], args.max_steps)
        return tuple(values)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: Any
    ) -> tuple[list[Any], Any]:
        # an optimizer step starts here, before its batches are fetched: a preemption stop
        # agreed now saves the loader's position without them
        if self._loop is not None:
            self._loop.begin()
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _run_epoch(  # type: ignore[override]
        self, *, epoch: int, **kw: Any
    ) -> Any:
        """The Trainer's epoch, begun where the resumed loader stands (an epoch trained
        before the resume is passed over; the resumed one starts at its saved batch)."""
        kw["epoch"] = epoch
        at = self._resume_at
        if at is not None:
            if epoch < at[0]:
                return None  # trained before the resume
            self._resume_at = None
            if epoch == at[0] and at[1] > 0:
                ga = self.args.gradient_accumulation_steps
                if at[1] % ga:
                    raise RuntimeError(
                        f"resumed {at[1]} batches into epoch {epoch}, not a whole number of "
                        f"optimizer steps of {ga} batches: this run would not be exact"
                    )
                kw.update(
                    resume_from_checkpoint=_RESUMED,
                    epochs_trained=epoch,
                    steps_trained_in_current_epoch=at[1],
                )
                with _loader_positioned():
                    return super()._run_epoch(**kw)
        return super()._run_epoch(**kw)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # the Trainer computes the total norm every step (clipping or not), right before
        # the optimizer step: the non-finite check reads it instead of its own pass. Not
        # when a subclass overrides this method: its norm may not cover every gradient
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if type(self)._get_grad_norm is Trainer._get_grad_norm:
            self.rt.observe(grad_norm=norm)
        return norm

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Nothing: the runtime restored every rank's RNG with the rest of the state."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Where the Trainer would write checkpoint-N: the runtime's save (async)."""
        if self._loop is not None:
            self.store_flos()
            self._loop.save()

    def evaluate(self, *args: Any, **kw: Any) -> Any:
        # in phase `eval`, with its own timeout, not the forward phase of a training step
        with self.rt.phase("eval"):
            return super().evaluate(*args, **kw)

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
        out = super().compute_loss(model, inputs, *args, **kw)
        # before its backward: the non-finite check rides DDP's all-reduce (no collective of
        # its own), and the loss joins the step's fingerprint
        self.rt.observe(loss=out[0] if isinstance(out, tuple) else out)
        return out


class _Steps(transformers.TrainerCallback):
    """The Trainer's events that drive the runtime's step accounting."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer._begin_training()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        loop = self.trainer._loop
        if loop is not None:
            loop.end()
            if loop.stopping:  # `resilient check-resume` stops the run here
                control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.trainer._loop is not None:
            self.trainer._loop.finish()


@contextlib.contextmanager
def _loader_positioned() -> Iterator[None]:
    """For the one `_run_epoch` call that resumes mid-epoch: the Trainer would replay the
    epoch's first batches through Accelerate's `skip_first_batches`; this loader is at its
    saved position already, so the Trainer gets it back unchanged. Scoped to that call and to
    this adapter's loader: any other loader goes to Accelerate's function."""
    original = hf_trainer.skip_first_batches

    def positioned(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, EpochBatches):
            return dataloader
        return original(dataloader, num_batches)

    hf_trainer.skip_first_batches = positioned
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original
