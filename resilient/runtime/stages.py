"""Pipeline stages: the split of the model's layers, checked once at `track()`.

A pipeline stage keeps the whole model's module names and holds only its own layers, so its
state dict is the model's, less the other stages' keys (docs/porting.md#pipelines). Every
rank of one stage (its data-parallel and tensor-parallel peers) must hold the same keys, and
two stages must not both hold one: either would be a split that differs between ranks of one
attempt, and its checkpoint would hold a layer twice or not at all.

A pipeline needs a mesh with a `pp` dimension to say so. Without one (torch's pipelining
tutorial builds none), ranks whose parameter names fall into disjoint sets, none held by two
of the sets, are a pipeline split: `track()` refuses it before step 0 with that fix first, not
at the first save after the steps ran (`unmeshed_split`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from resilient.errors import ConfigError
from resilient.mesh import MeshLayout

__all__ = [
    "agree_split",
    "check_split",
    "even_micro_batches",
    "stage_of",
    "uneven_micro_batches",
    "unmeshed_split",
]


def stage_of(layout: MeshLayout, rank: int) -> int:
    """`rank`'s coordinate along the mesh's pp dimension (0 without one)."""
    for d, c in zip(layout.dims, layout.coords(rank), strict=True):
        if d.role == "pp":
            return c
    return 0


def agree_split(model: nn.Module | None, layout: MeshLayout, ctx: Any, log: Any) -> int | None:
    """This rank's stage (its pp coordinate) when the run is pipelined (a pp dimension of
    size > 1 in `layout`), else None; a pipelined run's split is checked over the checkpoint
    group of `ctx` and logged as `pipeline.split`.

    The replay fingerprints of a pipeline are the first stage's inputs and the last stage's
    loss: a later stage's first forward in each process is torch's shape inference on
    uninitialised tensors (PipelineStage without input_args), not the step's activations."""
    if layout.size("pp") <= 1:
        if model is not None and ctx.distributed:
            unmeshed_split(model, ctx.checkpoint_group)
        return None
    stage = stage_of(layout, ctx.rank)
    if model is not None and ctx.distributed:
        split = check_split(model, layout, ctx.rank, ctx.checkpoint_group)
        log.info("pipeline.split", stage=stage, keys=split)
    return stage


def unmeshed_split(model: nn.Module, group: Any) -> None:
    """ConfigError, the fix first, when the ranks of `group` hold parameters under disjoint
    sets of names (a pipeline split) and no mesh gave a pp dimension. One gather of a hash of
    the names; the names themselves only when the hashes differ. Overlapping sets are left to
    the save's same-name check, which names the keys (checkpoint/duplicates.py)."""
    names = sorted(n for n, _ in model.named_parameters())
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    hashes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, digest, group=group)
    if len(set(hashes)) == 1:
        return
    every: list[Any] = [None] * len(hashes)
    dist.all_gather_object(every, names, group=group)
    sets: dict[str, tuple[int, list[str]]] = {}
    for r, (h, held) in enumerate(zip(hashes, every, strict=True)):
        sets.setdefault(h, (r, held))
    split = list(sets.values())
    if any(not held for _, held in split):
        return
    for i, (_, a) in enumerate(split):
        if any(set(a) & set(b) for _, b in split[i + 1 :]):
            return
    said = "; ".join(f"rank {r}: {len(held)} such as {held[0]!r}" for r, held in split[:4])
    raise ConfigError(
        "pass mesh= with a 'pp' dimension to track(): the ranks hold disjoint sets of "
        f"parameters ({said}), a pipeline split, and no mesh says so. For example "
        "mesh = init_device_mesh(device, (pp,), mesh_dim_names=('pp',)), or ('dp', 'pp') with "
        "data-parallel replicas of each stage, then rt.track(..., mesh=mesh). Without it the "
        "stages' optimizers differ under one name and the first save would be refused; "
        "nothing was trained (docs/porting.md#pipelines)"
    )


def check_split(model: nn.Module, layout: MeshLayout, rank: int, group: Any) -> dict[str, Any]:
    """Agree the layers each stage holds over `group` (every rank calls it); the split as
    {stage: number of keys} for the event. ConfigError on every rank, naming the ranks and
    the keys, when ranks of one stage hold other keys or two stages hold one key."""
    keys = sorted(get_model_state_dict(model))
    mine = (stage_of(layout, rank), keys)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    by_stage: dict[int, tuple[int, set[str]]] = {}
    problems: list[str] = []
    for r, (stage, held) in enumerate(every):
        first = by_stage.setdefault(stage, (r, set(held)))
        if first[1] != set(held):
            diff = sorted(first[1] ^ set(held))
            problems.append(
                f"ranks {first[0]} and {r} are both stage {stage} but hold other layers "
                f"(keys only one of them holds: {diff[:6]}{'...' if len(diff) > 6 else ''})"
            )
    stages = sorted(by_stage)
    for i, a in enumerate(stages):
        for b in stages[i + 1 :]:
            both = sorted(by_stage[a][1] & by_stage[b][1])
            if both:
                problems.append(
                    f"stages {a} and {b} both hold {both[:6]}{'...' if len(both) > 6 else ''}"
                )
    if problems:
        raise ConfigError(
            "the pipeline split differs between ranks of this attempt: "
            + "; ".join(problems[:4])
            + ". Every rank must compute the same split (the same stage boundaries from the "
            "same arguments), each stage keeping only its own layers under the model's names: "
            "stages that number their own layers from 0 all hold '0.weight'; keep the whole "
            "model and replace the other stages' layers by nn.Identity() "
            "(docs/porting.md#pipelines)"
        )
    return {str(s): len(by_stage[s][1]) for s in stages}


def even_micro_batches(model: nn.Module, step: Callable[[], int]) -> Any:
    """A hook on a pipeline stage's module: ConfigError when the micro-batches of one step
    differ in size. torch's schedules split the batch into n_microbatches chunks along its
    first dimension, unevenly when that does not divide it (8 into 3: 3, 3 and 2), so the
    mean of the micro-batches' losses is no longer the batch's, and a static stage's shapes
    fail. Raised in the first step's forwards, before any weight changed; each stage sees it."""
    seen: dict[str, Any] = {"step": None, "sizes": []}

    def check(_module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # torch < 2.13's shape inference (zeros like the first micro-batch)
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if first is None:
            return
        if seen["step"] != step():
            seen["step"], seen["sizes"] = step(), []
        sizes: list[int] = seen["sizes"]
        sizes.append(int(first.shape[0]))
        if sizes[-1] != sizes[0]:
            raise uneven_micro_batches(seen["step"], sizes)

    return model.register_forward_pre_hook(check)


def uneven_micro_batches(step: int | None, sizes: list[int]) -> ConfigError:
    """The refusal of a step whose pipeline micro-batches have these `sizes`."""
    return ConfigError(
        f"the pipeline's micro-batches of step {step} differ in size "
        f"({sorted(set(sizes), reverse=True)} samples): "
        "the schedule's n_microbatches does not divide the batch each stage draws. "
        "Choose a number of micro-batches that divides the batch size (or a batch "
        "size it divides) (docs/porting.md#pipelines)"
    )
