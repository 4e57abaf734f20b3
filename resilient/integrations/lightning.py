"""Lightning's Trainer under the runtime, for two changed lines:

    from resilient.integrations.lightning import Resilient
    trainer = L.Trainer(..., callbacks=[Resilient(), ...])   # was: callbacks=[...]

launched by `resilient run` (or torchrun) as before. The runtime then owns what a resume
needs, and Lightning keeps everything else (its loop, logging, validation, callbacks, its own
ModelCheckpoint files):

- checkpoints: sharded DCP saves, async and atomic, each time Lightning writes a checkpoint
  (ModelCheckpoint's schedule) and every `save_every_steps`, in `$RESILIENT_CHECKPOINT_DIR`
  (`resilient run --checkpoint-url`) or `<default_root_dir>/resilient`;
- data: the training DataLoader is rebuilt as a StatefulDataLoader over a
  StatefulDistributedSampler, so a resume continues the epoch where it stopped instead of
  replaying its batches, and each sample's randomness is seeded from (seed, epoch, index),
  loader workers included;
- state: model, optimizer, schedulers, every rank's RNG, the fit loop's progress (global
  step, epoch, batches, validation) and the callbacks' and datamodule's state;
- faults: a preemption signal stops every rank at one agreed step, saved outside the signal
  handler (exit 85, nothing lost; Lightning's own SIGTERM and SLURM requeue handlers are not
  installed), a hang is named, an exception or OOM on one rank takes the others down with it,
  a non-finite loss restarts from the newest checkpoint and stops (exit 87) when it comes back.

`Resilient(**options)` takes `resilient.init()`'s options (`checkpoint_dir=` for the
location). Do not pass `ckpt_path=` to fit(): the run resumes by itself. What is exact and
what is not: docs/integrations.md#lightning.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl

import resilient
from resilient.errors import ConfigError
from resilient.integrations._lightning_parts import (
    _UNTESTED,
    EpochBatches,
    LightningState,
    check_lightning,
    check_module,
    check_seams,
    check_trainer,
    closure_first,
    epoch_batches,
    seed_of,
    step_through_call,
    total_steps,
    training_loader,
    use_loader,
)
from resilient.runtime.driven import DrivenLoop
from resilient.runtime.runtime import Runtime

__all__ = ["Resilient"]

_MESH_ROLES = {"data_parallel": "shard", "tensor_parallel": "tp"}
"""ModelParallelStrategy's mesh dimensions by the runtime's role names."""

check_lightning()


class Resilient(pl.Callback):
    """A Lightning callback that makes the runtime own checkpoints, the data position and
    faults. `options` are `resilient.init()`'s; the runtime is `self.rt` from setup() on."""

    def __init__(self, **options: Any) -> None:
        self.options = dict(options)
        self.rt: Runtime | None = None
        self.loop: DrivenLoop | None = None
        self._state: LightningState | None = None
        self._batches: EpochBatches | None = None
        self._trainer: Any = None
        self._save_due = False
        self._eval: Any = None  # the open phase("eval") block of a validation run

    # ------------------------------------------------------------------ before the loop
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Once the process group exists: the runtime (it adopts Lightning's group), and
        Lightning's signal handlers kept out (preemption is the runtime's)."""
        if stage != "fit" or self.rt is not None:
            return
        check_seams(trainer)
        check_trainer(trainer)
        opts = dict(self.options)
        url = opts.pop("checkpoint_dir", None) or os.environ.get(
            "RESILIENT_CHECKPOINT_DIR", os.path.join(trainer.default_root_dir, "resilient")
        )
        self.rt = resilient.init(url, **opts)
        self._trainer = trainer
        # Lightning's SIGTERM handler broadcasts inside the handler and stops after the
        # current batch, and its SLURM handler saves inside the handler: neither is exact
        trainer._signal_connector.register_signal_handlers = _signals_are_resilients
        if type(trainer.strategy).__name__ in _UNTESTED:
            self.rt.log.warning(
                "lightning.strategy_untested",
                strategy=type(trainer.strategy).__name__,
                reason="saved through DCP's state dicts as FSDP2 is, but Lightning runs it on "
                "GPUs only: untested (ModelParallelStrategy with fully_shard is tested)",
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Model wrapped, optimizer made, before Lightning restores or builds its loops: the
        training loader rebuilt stateful, the state tracked and resumed."""
        rt = self.rt
        assert rt is not None, "setup() made the runtime"
        if self.loop is not None:
            raise ConfigError(
                "fit() runs once per Resilient callback (its runtime resumed already): make a "
                "new Trainer with a new Resilient() for another fit"
            )
        check_module(trainer, pl_module)
        closure_first(trainer)  # the gradients are checked after backward, before the update
        step_through_call(trainer)  # the tracked module's hooks see each step
        user_loader = trainer.fit_loop._data_source.dataloader()
        loader = training_loader(user_loader, rt.rank, rt.world_size, seed_of())
        per_epoch = epoch_batches(trainer, loader)
        self._batches = EpochBatches(trainer, loader, per_epoch, self._boundary)
        use_loader(trainer, self._batches)
        configs = trainer.lr_scheduler_configs
        extras: dict[str, Any] = {f"scheduler_{i}": c.scheduler for i, c in enumerate(configs)}
        extras.pop("scheduler_0", None)
        precision = trainer.precision_plugin
        if precision.state_dict():  # a GradScaler's, for 16-mixed
            extras["lightning_precision"] = precision
        mesh = getattr(trainer.strategy, "device_mesh", None)  # ModelParallelStrategy's
        if mesh is not None:
            extras.update(mesh=mesh, mesh_roles=_MESH_ROLES)
        self._state = LightningState(trainer, self)
        rt.track(
            model=trainer.strategy.model,
            optimizer=trainer.optimizers[0],
            scheduler=configs[0].scheduler if configs else None,
            loader=loader,
            lightning=self._state,
            **extras,
        )
        self.loop = DrivenLoop(rt, total_steps(trainer, per_epoch))
        self._batches.loop = self.loop
        step = self.loop.start()
        if step != trainer.global_step:
            raise RuntimeError(
                f"resumed at step {step} but Lightning's global_step is {trainer.global_step}: "
                "the checkpoint does not belong to this Trainer"
            )
        if step:
            rt.log.info(
                "lightning.resumed",
                step=step,
                epoch=trainer.current_epoch,
                batch=self.loop.batches.taken_in_epoch() if self.loop.batches else 0,
            )

    # ------------------------------------------------------------------ the steps
    def _boundary(self) -> bool:
        """Before an optimizer step's first batch is fetched (EpochBatches): a save that
        came due, then `resilient check-resume`'s stop or the step's opening (where a
        preemption stop is agreed). True ends the fit loop here."""
        loop = self.loop
        assert loop is not None
        if self._save_due:
            self._save_due = False
            loop.save()
        if loop.stopping:
            loop.save()
            self._trainer.should_stop = True
            return True
        loop.begin()
        return False

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._state is not None:
            self._state.restore_stepped_count()  # once, after a resume (LightningState)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        # before its backward: the non-finite check rides DDP's all-reduce, and the loss
        # joins the step's fingerprint
        if self.rt is not None and self.loop is not None:
            self.rt.observe(loss=loss)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loop, rt = self.loop, self.rt
        if loop is None or rt is None or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        loop.end()  # the optimizer stepped: the step is counted and checked
        every = rt.config.save_every_steps
        if every and rt.step % every == 0:
            self._save_due = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Lightning writes a checkpoint (ModelCheckpoint, trainer.save_checkpoint): the
        runtime saves too, at the next step boundary, where the loop's state is whole."""
        if self.loop is not None:
            self._save_due = True

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Lightning restores a .ckpt (fit(ckpt_path=...)): refused with the fix."""
        check_module(trainer, pl_module, ckpt_path=trainer.ckpt_path or "a Lightning .ckpt")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # in phase `eval`: its own (fixed) timeout, and out of the learned statistics of the
        # training phases its forwards pass through
        if self.rt is not None and self._eval is None:
            self._eval = self.rt.phase("eval")
            self._eval.__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._eval is not None:
            block, self._eval = self._eval, None
            block.__exit__(None, None, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.loop is not None:
            self.loop.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.loop is not None:
            self.loop.abort()


def _signals_are_resilients() -> None:
    """In place of Lightning's `_SignalConnector.register_signal_handlers`: the runtime
    handles SIGTERM and SIGUSR1 (a stop at an agreed step, its save outside the handler)."""
