"""The pieces of the Lightning adapter (resilient/integrations/lightning.py) that are not the
callback itself: the tested versions and the private seams they must have, the checks of the
Trainer's options, the optimizer step's order, the training loader, the epochs Lightning
iterates, and Lightning's own state (its loops' progress, its callbacks' state) as a
checkpoint entry."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies.strategy import Strategy as _Strategy
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from packaging.version import Version
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from resilient.data.seeded import SeededSamples
from resilient.errors import ConfigError
from resilient.runtime.driven import DrivenLoop

TESTED = (Version("2.5"), Version("3.0"))
"""lightning releases this adapter was tested with: [first, last)."""

SEAMS = {
    "Trainer": ("fit_loop", "_signal_connector", "accumulate_grad_batches", "num_training_batches"),
    "_FitLoop": ("_data_source", "_combined_loader", "epoch_loop", "state_dict", "load_state_dict"),
    "_TrainingEpochLoop": ("_should_accumulate", "_batches_that_stepped"),
    "_SignalConnector": ("register_signal_handlers",),
    "Precision": ("_wrap_closure", "optimizer_step"),
    "Strategy": ("_forward_redirection", "training_step", "precision_plugin"),
}
"""The private names the adapter relies on: where the training loader comes from (the fit
loop's data source), whether a batch ends an optimizer step, the signal handlers it keeps
Lightning from installing, the closure it runs before `optimizer.step()` (`closure_first`)
and the redirection of `training_step` through the module's `__call__`. Checked at the start
of fit(), refused with the tested range when one moved."""

_UNTESTED = ("FSDPStrategy",)
"""FSDP1 through Lightning's FSDPStrategy: its state goes through DCP's state dicts as FSDP2's
does, but Lightning allows it on GPUs only, so this path is untested here. FSDP2 through
ModelParallelStrategy (fully_shard in configure_model) runs on CPU and is tested."""

_SUPPORTED = ("DDPStrategy", "SingleDeviceStrategy", "ModelParallelStrategy", *_UNTESTED)
_REFUSED = ("DeepSpeedStrategy", "XLAStrategy", "SingleDeviceXLAStrategy", "XLAFSDPStrategy")
"""Subclasses of the supported ones that keep their state and step their own way."""


def check_lightning() -> None:
    """ConfigError unless this lightning is in the tested range."""
    have = Version(Version(lightning.__version__).base_version)
    lo, hi = TESTED
    if not lo <= have < hi:
        raise ConfigError(
            f"resilient.integrations.lightning was tested with lightning >={lo},<{hi}; this is "
            f"{lightning.__version__}: install a tested release "
            "(pip install 'resilient[lightning]')"
        )


def check_seams(trainer: Any) -> None:
    """ConfigError naming the first private name this release no longer has."""
    where = {
        "Trainer": trainer,
        "_FitLoop": trainer.fit_loop,
        "_TrainingEpochLoop": trainer.fit_loop.epoch_loop,
        "_SignalConnector": trainer._signal_connector,
        "Precision": trainer.precision_plugin,
        "Strategy": trainer.strategy,
    }
    for owner, names in SEAMS.items():
        for name in names:
            if not hasattr(where[owner], name):
                lo, hi = TESTED
                raise ConfigError(
                    f"lightning {lightning.__version__}: {owner}.{name} is gone; "
                    f"resilient.integrations.lightning needs a tested release (>={lo},<{hi})"
                )


def check_trainer(trainer: Any) -> None:
    """Refuse, with the fix, the Trainer options that defeat an exact resume."""
    strategy = type(trainer.strategy).__name__
    names = {c.__name__ for c in type(trainer.strategy).__mro__}
    if names & set(_REFUSED) or not names & set(_SUPPORTED):
        raise ConfigError(
            f"strategy {strategy} is not supported by resilient.integrations.lightning: use "
            "strategy='ddp' or ModelParallelStrategy (FSDP2), or port the loop by hand "
            "(docs/porting.md)"
        )
    if trainer.reload_dataloaders_every_n_epochs:
        raise ConfigError(
            "Trainer(reload_dataloaders_every_n_epochs=...) is not supported: resilient builds "
            "the training loader once and saves its position; drop the option"
        )
    if trainer.overfit_batches:
        raise ConfigError(
            "Trainer(overfit_batches=...) is not supported: it replaces the sampler; use "
            "limit_train_batches instead"
        )


def check_module(trainer: Any, pl_module: Any, ckpt_path: str | None = None) -> None:
    """Refuse what the adapter's step accounting cannot follow (after configure_optimizers),
    and a Lightning checkpoint to resume from."""
    ckpt_path = ckpt_path or trainer.ckpt_path
    if ckpt_path:
        raise ConfigError(
            f"trainer.fit(ckpt_path={ckpt_path!r}): with the Resilient callback the run resumes "
            "from resilient's own checkpoints by itself, exactly; a Lightning .ckpt holds no "
            "RNG state and no loader position. Drop ckpt_path; to start a new run from its "
            "weights, load them into the LightningModule before fit() "
            "(model.load_state_dict(torch.load(path)['state_dict']))"
        )
    if not pl_module.automatic_optimization:
        raise ConfigError(
            "automatic_optimization=False is not supported: resilient counts a step at each "
            "optimizer step Lightning's automatic optimization makes; port the loop by hand"
        )
    if len(trainer.optimizers) != 1:
        raise ConfigError(
            f"configure_optimizers() made {len(trainer.optimizers)} optimizers: "
            "resilient.integrations.lightning supports one"
        )
    if isinstance(trainer.optimizers[0], torch.optim.LBFGS):
        raise ConfigError(
            "LBFGS evaluates its closure several times a step: resilient checks the gradients "
            "once, after the step's backward; use another optimizer or port the loop by hand"
        )


def closure_first(trainer: Any) -> None:
    """Lightning's default precision plugins step the optimizer with the training step as its
    closure, `optimizer.step(closure)`: forward and backward run inside step(), after the
    optimizer's step hooks, where the runtime checks the step's gradients for non-finite
    values before the update. Run the closure (forward, backward, on_before_optimizer_step,
    gradient clipping) first, then `optimizer.step()`: the same operations in the same order
    (what Lightning's own GradScaler path does), with the check on the reduced gradients."""
    plugin = trainer.precision_plugin
    if getattr(plugin, "scaler", None) is not None:
        return  # MixedPrecision with a GradScaler: its closure runs before step() already

    def optimizer_step(optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        result = plugin._wrap_closure(model, optimizer, closure)
        optimizer.step(**kwargs)
        return result

    plugin.optimizer_step = optimizer_step


def step_through_call(trainer: Any) -> None:
    """Where the strategy calls `training_step` on the module directly (one device,
    ModelParallelStrategy), route it through the module's `__call__`, as Lightning does for
    DDP: the runtime's hooks on the tracked module (phases for the hang report, the step's
    input fingerprint) then see each step. The same call, the same computation."""
    strategy, module = trainer.strategy, trainer.lightning_module
    if strategy.model is not module or type(strategy).training_step is not _Strategy.training_step:
        return
    redirect = strategy._forward_redirection

    def training_step(*args: Any, **kwargs: Any) -> Any:
        with strategy.precision_plugin.train_step_context():
            return redirect(module, module, "training_step", *args, **kwargs)

    strategy.training_step = training_step


def training_loader(dl: Any, rank: int, world: int, seed: int) -> StatefulDataLoader:
    """The user's training DataLoader rebuilt stateful: a StatefulDistributedSampler (shuffled
    by `seed`, as Lightning's own DistributedSampler would be) over the dataset, with each
    sample's RNG seeded from (seed, epoch, index) so loader workers augment a resumed epoch as
    they did the first. Anything that cannot be positioned is refused with the fix."""
    if not isinstance(dl, DataLoader):
        raise ConfigError(
            f"the train dataloader is a {type(dl).__name__}: resilient needs one torch "
            "DataLoader (one training loader, not a collection) to rebuild it stateful"
        )
    data = dl.dataset
    params: dict[str, Any] = {
        "batch_size": dl.batch_size,
        "collate_fn": dl.collate_fn,
        "num_workers": dl.num_workers,
        "pin_memory": dl.pin_memory,
        "drop_last": dl.drop_last,
        "timeout": dl.timeout,
        "worker_init_fn": dl.worker_init_fn,
        "multiprocessing_context": dl.multiprocessing_context,
    }
    if dl.num_workers:
        params.update(persistent_workers=dl.persistent_workers, prefetch_factor=dl.prefetch_factor)
    if isinstance(data, IterableDataset):
        if not hasattr(data, "state_dict"):
            raise ConfigError(
                f"train dataset {type(data).__name__} is an IterableDataset without "
                "state_dict(): its position cannot be saved, so a resume would repeat or skip "
                "samples. Give it state_dict()/load_state_dict() (torchdata's Stateful "
                "protocol) or use a map-style Dataset"
            )
        return StatefulDataLoader(data, **params)  # it shards and positions itself
    sampler = dl.sampler
    if type(dl.batch_sampler) is not BatchSampler or dl.batch_size is None:
        raise ConfigError(
            f"the train DataLoader has a batch_sampler of its own "
            f"({type(dl.batch_sampler).__name__}): it cannot be repositioned mid-epoch. Use "
            "batch_size= and shuffle=, or port the loop by hand (docs/porting.md)"
        )
    if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):
        raise ConfigError(
            f"the train DataLoader has a sampler of its own ({type(sampler).__name__}): it "
            "cannot be repositioned mid-epoch. Use shuffle=True (resilient shards it with a "
            "StatefulDistributedSampler), or port the loop by hand (docs/porting.md)"
        )
    shuffle = world > 1 or not isinstance(sampler, SequentialSampler)  # as Lightning shards
    spl = StatefulDistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=dl.drop_last
    )
    return StatefulDataLoader(SeededSamples(data, seed), sampler=spl, **params)


def epoch_batches(trainer: Any, loader: Any) -> int:
    """Batches per epoch as Lightning counts them (limit_train_batches applied)."""
    n = len(loader)
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        return min(n, limit)
    return n if limit is None or float(limit) >= 1.0 else int(n * float(limit))


def total_steps(trainer: Any, per_epoch: int) -> int:
    """The optimizer steps fit() makes: max_steps, or max_epochs of ceil(batches / accum)."""
    steps_per_epoch = math.ceil(per_epoch / trainer.accumulate_grad_batches)
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    by_epochs = None if max_epochs in (None, -1) else steps_per_epoch * max_epochs
    if max_steps != -1:
        return max_steps if by_epochs is None else min(max_steps, by_epochs)
    if by_epochs is None:
        raise ConfigError("Trainer(max_epochs=-1) with no max_steps: set max_steps or max_epochs")
    return by_epochs


def use_loader(trainer: Any, batches: Any) -> None:
    """Lightning's fit loop takes `batches` as its training loader: its data source becomes
    the instance, and a combined loader made earlier (estimated_stepping_batches in
    configure_optimizers) is dropped so the fit loop builds its own over `batches`."""
    trainer.fit_loop._data_source = _DataLoaderSource(batches, "train_dataloader")
    trainer.fit_loop._combined_loader = None


def seed_of() -> int:
    """The sampler's seed: seed_everything's (PL_GLOBAL_SEED), else 0 as Lightning's own."""
    return int(os.environ.get("PL_GLOBAL_SEED", "0") or 0)


class EpochBatches:
    """What Lightning's fit loop iterates: the tracked loader through the runtime, one epoch
    per `iter()`, a resumed epoch continued where it stopped instead of replayed. Each
    optimizer step's first batch is fetched after `boundary()` (which opens the step, saves
    when one is due, and may stop the run); it returns True to end the fit loop here."""

    def __init__(
        self, trainer: Any, loader: StatefulDataLoader, per_epoch: int, boundary: Callable[[], bool]
    ) -> None:
        self.trainer = trainer
        self.loader = loader
        self.per_epoch = per_epoch
        self.boundary = boundary
        self.loop: DrivenLoop | None = None
        self.stopped = False

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.loop is None or self.loop.batches is None:
            raise RuntimeError("Lightning iterated the training loader before on_fit_start")
        if self.stopped:
            return
        b = self.loop.enter_epoch(int(self.trainer.current_epoch), "Lightning")
        accum = self.trainer.accumulate_grad_batches
        while (taken := b.taken_in_epoch()) < self.per_epoch:
            if taken % accum == 0 and self.boundary():
                self.stopped = True
                return
            yield self.loop.next_batch()


class LightningState:
    """Lightning's own state as a checkpoint entry every rank holds alike: the fit loop's
    progress (epochs, batches, optimizer and scheduler steps, validation), every callback's
    state_dict (ModelCheckpoint's best paths and scores, EarlyStopping's wait...) and the
    datamodule's. Loading it puts the fit loop where it stood, as Lightning's own resume
    would, without its batches."""

    def __init__(self, trainer: Any, skip: Any) -> None:
        self.trainer = trainer
        self.skip = skip  # the Resilient callback: no state of its own
        self.stepped_at_load: int | None = None
        """The loaded count of batches that stepped, until `restore_stepped_count()`."""

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        loops = t.fit_loop.state_dict()
        callbacks = {
            cb.state_key: cb.state_dict()
            for cb in t.callbacks
            if cb is not self.skip and cb.state_dict()
        }
        dm = t.datamodule
        return {
            "fit_loop": loops,
            "callbacks": callbacks,
            "datamodule": dm.state_dict() if dm is not None else {},
            "global_step": int(t.global_step),
            "batches_that_stepped": int(t.fit_loop.epoch_loop._batches_that_stepped),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        t.fit_loop.load_state_dict(copy.deepcopy(sd["fit_loop"]))
        states = sd["callbacks"]
        for cb in t.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(copy.deepcopy(states[cb.state_key]))
        if t.datamodule is not None and sd["datamodule"]:
            t.datamodule.load_state_dict(sd["datamodule"])
        self.stepped_at_load = sd.get("batches_that_stepped")
        if int(t.global_step) != int(sd["global_step"]):
            raise RuntimeError(
                f"Lightning's global_step is {t.global_step} after loading, the checkpoint "
                f"says {sd['global_step']}: this lightning release restores its loops otherwise"
            )

    def restore_stepped_count(self) -> None:
        """At the first batch after a load: the count of batches that stepped (the step the
        loggers write) as it was saved. Lightning's restart adds one to it for a checkpoint
        it assumes was written before the count went up (ModelCheckpoint's, in
        on_train_batch_end); the runtime saves at a step's opening, after it went up, and at
        an epoch's first step Lightning's restart takes that for its own case."""
        if self.stepped_at_load is not None:
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.stepped_at_load
            self.stepped_at_load = None
