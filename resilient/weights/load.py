"""Weights into a model from any source: `resilient.load_model`, and the runtime's `init_from`.

A resilient checkpoint goes through the checkpoint manager's model-only load: verified
against its manifest and resharded by DCP onto this world size and layout. A safetensors
directory or a torch.save file is read by every rank, a tensor at a time, and each rank
copies its own part: the whole tensor into a plain or DDP module, its shard into an FSDP2
DTensor (`distribute_tensor` with no source rank: every rank slices the same full tensor, no
collective).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resilient.checkpoint import CheckpointConfig, CheckpointManager
from resilient.checkpoint.loading import keys_said, misfit
from resilient.errors import CheckpointMismatchError
from resilient.log import get_logger
from resilient.weights.names import matches_any
from resilient.weights.sources import FileWeights, Source, identify

__all__ = ["Loaded", "load_model"]


@dataclass(frozen=True, slots=True)
class Loaded:
    """What `load_model` did."""

    kind: str
    """The source's kind: "resilient", "safetensors" or "torch"."""
    url: str
    step: int | None
    """The checkpoint step loaded (resilient sources)."""
    keys: int
    """Tensors loaded."""
    excluded: int
    """Keys of the model left as they were by `exclude`."""
    seconds: float


def load_model(
    src: str | os.PathLike[str],
    model: nn.Module,
    *,
    step: int | None = None,
    strict: bool = True,
    exclude: Sequence[str] = (),
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
) -> Loaded:
    """Load `src`'s model weights into `model`: a plain module, DDP or FSDP2, on one process
    or on every rank of the default group (all ranks call it).

    `src`: a resilient checkpoint location (the newest committed step, or `step`; a
    `step_*` directory names its step), a Hugging Face safetensors directory, or a torch.save
    file. `exclude`: glob patterns of keys left as they are (a new head). `strict`: any other
    key that one side has and the other lacks raises CheckpointMismatchError naming them;
    with False only the keys both have are loaded. A shape that differs always raises.
    """
    t0 = time.perf_counter()
    source = identify(src, step=step)
    skip = _excluder(exclude)
    n_excluded = sum(1 for k in _model_keys(model) if skip(k))
    if source.kind == "resilient":
        config = CheckpointConfig(
            url=source.url, storage_options=dict(storage_options or {}), async_save=False
        )
        mgr = CheckpointManager(config, process_group=process_group)
        try:
            at, names = mgr.load_weights(model, source.step, strict=strict, exclude=skip)
        finally:
            mgr.close()
        loaded_step: int | None = at
        keys = len(names)
    else:
        loaded_step = None
        keys = _load_file(FileWeights(source), source, model, strict=strict, skip=skip)
    done = Loaded(
        kind=source.kind,
        url=source.url,
        step=loaded_step,
        keys=keys,
        excluded=n_excluded,
        seconds=round(time.perf_counter() - t0, 4),
    )
    get_logger().info("weights.load", **{k: getattr(done, k) for k in done.__slots__})
    return done


def _excluder(patterns: Sequence[str]) -> Any:
    patterns = tuple(patterns)
    return lambda name: bool(patterns) and matches_any(name, patterns)


def _model_keys(model: nn.Module) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [k for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)]


@torch.no_grad()
def _load_file(
    weights: FileWeights, source: Source, model: nn.Module, *, strict: bool, skip: Any
) -> int:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    live = {
        k: v
        for k, v in get_model_state_dict(model).items()
        if isinstance(v, torch.Tensor) and not skip(k)
    }
    have = {k: v for k, v in weights.shapes().items() if not skip(k)}
    missing, unexpected, shapes = misfit(
        {k: tuple(v.shape) for k, v in live.items()},
        {k: tuple(shape) for k, (shape, _dtype) in have.items()},
        source="source",
    )
    if shapes or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(
            f"{source.url} does not fit the model: {keys_said(missing, unexpected, shapes)}. "
            "Exclude the keys that differ (exclude=/init_exclude=), or strict=False to load "
            "the keys both have."
        )
    names = sorted(set(live) & set(have))
    for name, full in weights.tensors(names):
        target = live[name]
        if isinstance(target, DTensor):
            part = distribute_tensor(
                full.to(target.device), target.device_mesh, target.placements, src_data_rank=None
            )
            target.to_local().copy_(part.to_local())
        else:
            target.copy_(full)
    return len(names)
