"""The pieces of the Hugging Face adapter (resilient/integrations/hf.py) that are not the
Trainer itself: the tested versions and the private seams they must have, the checks of the
Trainer's options, the training loader, and the Trainer's own state as checkpoint entries."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from packaging.version import Version
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from resilient.data.seeded import SeededSamples
from resilient.errors import ConfigError
from resilient.runtime.driven import DrivenLoop

TESTED = (Version("5.3"), Version("6.0"))
"""transformers releases this adapter was tested with: [first, last)."""

SEAMS = {
    "_run_epoch": ("epoch", "resume_from_checkpoint", "steps_trained_in_current_epoch"),
    "get_batch_samples": ("epoch_iterator", "num_batches"),
    "_save_checkpoint": ("model", "trial"),
    "_load_rng_state": ("checkpoint",),
    "set_initial_training_values": ("args", "dataloader"),
    "_get_grad_norm": ("model", "grad_norm"),
}
"""The Trainer methods the adapter overrides or calls, with the parameters it relies on. The
public callbacks cannot place a step's start before its batches are fetched, nor resume an
epoch without replaying it, so these are the fence: checked at import, each against the
release's own signature, and refused with the tested range when one moved."""


def check_transformers() -> None:
    """ConfigError unless this transformers is in the tested range and has the seams."""
    have = Version(Version(transformers.__version__).base_version)
    lo, hi = TESTED
    if not lo <= have < hi:
        raise ConfigError(
            f"resilient.integrations.hf was tested with transformers >={lo},<{hi}; this is "
            f"{transformers.__version__}: install a tested release "
            f"(pip install 'resilient[hf]')"
        )
    for name, params in SEAMS.items():
        fn = getattr(transformers.Trainer, name, None)
        got = set(inspect.signature(fn).parameters) if fn is not None else set()
        if not set(params) <= got:
            raise ConfigError(
                f"transformers {transformers.__version__}: Trainer.{name} no longer takes "
                f"{sorted(set(params) - got)}; resilient.integrations.hf needs a tested "
                f"release (>={lo},<{hi})"
            )


def check_args(trainer: Any, log: Any) -> None:
    """Refuse the options that defeat an exact resume, with the fix; warn about those the
    runtime replaces."""
    a = trainer.args
    base = transformers.Trainer
    for name in ("_get_train_sampler", "get_train_dataloader"):
        if getattr(type(trainer), name) is not getattr(base, name) and not getattr(
            getattr(type(trainer), name), "__resilient__", False
        ):
            raise ConfigError(
                f"{type(trainer).__name__} overrides Trainer.{name}: resilient builds the "
                "training loader itself (a StatefulDataLoader over a StatefulDistributedSampler) "
                "so its position is saved; a sampler of your own cannot be repositioned. "
                "Remove the override, or port the loop by hand (docs/porting.md)"
            )
    refused = {
        "group_by_length": "a length-grouped sampler cannot be repositioned mid-epoch",
        "auto_find_batch_size": "it restarts the loop with another batch size; resilient's OOM "
        "guard agrees a retry on every rank instead (docs/operating.md)",
        "load_best_model_at_end": "it reloads a Trainer checkpoint-N directory, which resilient "
        "replaces with its own checkpoints; export the weights you want after training "
        "(`resilient export`)",
    }
    for opt, why in refused.items():
        if getattr(a, opt, False):
            raise ConfigError(f"TrainingArguments({opt}=True) is not supported: {why}")
    if str(getattr(a, "save_strategy", "")).endswith("best"):
        raise ConfigError(
            "TrainingArguments(save_strategy='best') is not supported: resilient saves on "
            "save_steps or each epoch; use 'steps' or 'epoch'"
        )
    data = trainer.train_dataset
    if isinstance(data, torch.utils.data.IterableDataset) and not hasattr(data, "state_dict"):
        raise ConfigError(
            f"train_dataset {type(data).__name__} is an IterableDataset without state_dict(): "
            "its position cannot be saved, so a resume would repeat or skip samples. Give it "
            "state_dict()/load_state_dict() (torchdata's Stateful protocol) or use a map-style "
            "Dataset"
        )
    ignored = {
        "ignore_data_skip": "resilient resumes the loader at its saved position and skips no "
        "batches, so there is nothing to ignore",
        "save_only_model": "resilient saves the whole training state, which an exact resume needs",
        "enable_jit_checkpoint": "resilient's preemption handling saves at an agreed step",
        "push_to_hub": "checkpoints are not pushed; push the final model with push_to_hub()",
    }
    for opt, why in ignored.items():
        if getattr(a, opt, False):
            log.warning("hf.option_ignored", option=opt, reason=why)
            if opt == "enable_jit_checkpoint":
                a.enable_jit_checkpoint = False


def training_loader(trainer: Any, rank: int, world: int) -> StatefulDataLoader:
    """The Trainer's training loader, built as `Trainer.get_train_dataloader` would, but
    stateful and not wrapped by Accelerate: a StatefulDistributedSampler (shuffled by
    data_seed or seed, repositionable on another world size) and per-sample RNG seeded from
    (seed, epoch, index), so loader workers augment a resumed epoch as they did the first."""
    a = trainer.args
    dataset, collate = trainer.train_dataset, trainer.data_collator
    if getattr(dataset, "column_names", None) is not None and hasattr(
        trainer, "_remove_unused_columns"
    ):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="training")
    seed = a.data_seed if a.data_seed is not None else a.seed
    workers = int(a.dataloader_num_workers)
    params: dict[str, Any] = {
        "batch_size": trainer._train_batch_size,
        "collate_fn": collate,
        "num_workers": workers,
        "pin_memory": bool(a.dataloader_pin_memory) and torch.cuda.is_available(),
        "drop_last": bool(a.dataloader_drop_last),
    }
    if workers:
        params["persistent_workers"] = bool(a.dataloader_persistent_workers)
        params["prefetch_factor"] = a.dataloader_prefetch_factor
        context = getattr(a, "dataloader_multiprocessing_context", None)  # since 5.15
        if context:
            params["multiprocessing_context"] = context
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return StatefulDataLoader(dataset, **params)  # it shards and positions itself
    sampler = StatefulDistributedSampler(
        dataset,
        num_replicas=world,
        rank=rank,
        shuffle=True,
        seed=seed,
        drop_last=bool(a.dataloader_drop_last),
    )
    return StatefulDataLoader(SeededSamples(dataset, seed), sampler=sampler, **params)


class EpochBatches:
    """What the Trainer iterates: the tracked loader through the runtime, one epoch per
    `iter()`, continuing a resumed epoch where it stopped instead of replaying it."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset  # Trainer.num_examples reads it
        self.batch_size = loader.batch_size
        self.loop: DrivenLoop | None = None
        self._epoch: int | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def position(self) -> tuple[int, int]:
        """(epoch, batches taken in it): where the Trainer's loop continues. The end of an
        epoch is the start of the next."""
        assert self.loop is not None and self.loop.batches is not None
        b = self.loop.batches
        taken = b.taken_in_epoch()
        return (b.epoch + 1, 0) if taken >= len(self) else (b.epoch, taken)

    def __iter__(self) -> Iterator[Any]:
        if self.loop is None:
            raise RuntimeError("the Trainer iterated its training loader before train() began")
        now = self.loop.batches
        epoch = self._epoch if self._epoch is not None else (now.epoch if now else 0)
        b = self.loop.enter_epoch(epoch, "the Trainer")
        for _ in range(len(self) - b.taken_in_epoch()):
            yield self.loop.next_batch()


class TrainerProgress:
    """The Trainer's state as a checkpoint entry every rank holds alike: TrainerState (global
    step, epoch, log history, the callbacks' exported state)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        states: dict[str, Any] = {}  # as TrainerState gathers them: a list per repeated class
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, transformers.trainer_callback.ExportableState):
                name = type(cb).__name__
                if name in states:
                    prior = states[name]
                    states[name] = [*(prior if isinstance(prior, list) else [prior]), cb.state()]
                else:
                    states[name] = cb.state()
        t.state.stateful_callbacks = states
        return {"trainer_state": json.dumps(dataclasses.asdict(t.state), sort_keys=True)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        loaded = json.loads(sd["trainer_state"])
        for key, value in loaded.items():
            setattr(t.state, key, value)
        with contextlib.suppress(AttributeError):
            t._load_callback_state()


class TrainerLossWindow:
    """Per rank: the loss the Trainer sums between two logs, so the first log after a
    resume averages the same steps as it would have."""

    _FIELDS = ("_total_loss_scalar", "_globalstep_last_logged", "current_flos")

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        out: dict[str, Any] = {f: getattr(t, f, 0) for f in self._FIELDS}
        loss = getattr(t, "_tr_loss", None)
        out["tr_loss"] = loss.detach().to("cpu", copy=True) if loss is not None else None
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        for f in self._FIELDS:
            setattr(t, f, sd[f])
        loss = getattr(t, "_tr_loss", None)
        if sd.get("tr_loss") is not None and loss is not None:
            loss.copy_(sd["tr_loss"])
