"""The check that no save silently keeps one of several different values saved under one name.

DCP takes a plain tensor (not a DTensor) or a plain value that more than one rank saves under
the same name for a replica, and writes one copy of it, from whichever rank its planner picks
(docs/internals.md#g-dcp-replicated-keys). That is right for DDP's parameters, which every
rank holds alike, and silently wrong for anything else. Two pipeline stages that both call
their layers `0.weight`, `1.weight`, ... lost half the model at every save, with exit 0; a
hand-written tensor parallel layer that holds its shard as a plain tensor would lose all but
one shard; two stages' optimizers save one `optim.param_groups.0.params` list between them.

So before anything is written, every rank fingerprints each plain leaf under the state
dict's "model" and "optim" entries, and the ranks compare the fingerprints of every name that
more than one of them holds. The rule does not depend on the mesh: whatever the layout, DCP
keeps one copy of a plain name, so ranks that save one name must save one value under it
(DTensors carry their own placement and are left to DCP; a mesh never makes two plain values
under one name right). A difference is refused on every rank with the names, the ranks and
the fix (`DivergentStateError`).

A tensor's fingerprint is the sum of its bytes read as 64-bit integers (narrower ones when its
size is not a multiple of 8), wrapping, with its dtype and shape: integer addition does not
depend on the order of the additions, so the same bits give the same fingerprint on any
device and any number of threads, and any one changed element changes it. One read of each
plain tensor, as fast as the non-finite check's sums; the compare travels in the all-gather
that check already makes (finite.py). Measured in docs/benchmarks.md ("Same-name check").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Set
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["CHECKED", "divergent", "fingerprints", "refusal"]

CHECKED = ("model", "optim")


def _leaves(obj: Any, key: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) of every plain leaf under `obj`, DTensors left out."""
    if isinstance(obj, DTensor):
        return
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}.{k}")
    elif isinstance(obj, list | tuple) and any(isinstance(v, dict | torch.Tensor) for v in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{key}.{i}")
    else:
        yield key, obj


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as the widest integers that tile them (int64 for almost every tensor)."""
    b = t.reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.numel() % size == 0:
            try:
                return b.view(dtype)
            except RuntimeError:  # a storage offset the wider type cannot start at
                continue
    return b.view(torch.int8)


def _tensor_print(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_contiguous():
        t = t.contiguous()
    ints = _as_ints(t) if t.numel() else torch.zeros(1, dtype=torch.int64, device=t.device)
    # summed in their own type, wrapping: as fast as a float sum (a sum into int64 from a
    # narrower type converts every element first, ten times slower)
    return f"{t.dtype}{tuple(t.shape)}", ints.sum(dtype=ints.dtype).to(torch.int64)


def fingerprints(sd: dict[str, Any], skip: Set[str] = frozenset()) -> dict[str, str]:
    """{key: fingerprint} of every plain leaf under `sd`'s CHECKED entries but `skip`."""
    tensors: list[tuple[str, str, torch.Tensor]] = []
    out: dict[str, str] = {}
    for entry in CHECKED:
        if entry not in sd:
            continue
        for key, leaf in _leaves(sd[entry], entry):
            if key in skip:
                continue
            if isinstance(leaf, torch.Tensor):
                head, total = _tensor_print(leaf)
                tensors.append((key, head, total))
            else:
                out[key] = hashlib.blake2b(repr(leaf).encode(), digest_size=8).hexdigest()
    if tensors:
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, _, total) in enumerate(tensors):
            by_device.setdefault(total.device, []).append(i)
        for idx in by_device.values():  # one sync per device
            sums = torch.stack([tensors[i][2] for i in idx]).tolist()
            for i, s in zip(idx, sums, strict=True):
                key, head, _ = tensors[i]
                out[key] = f"{head}:{s}"
    return out


def divergent(every: list[dict[str, str]]) -> dict[str, list[int]]:
    """{key: ranks} of each key that two or more ranks hold with different fingerprints;
    `every[r]` is rank r's `fingerprints`."""
    seen: dict[str, tuple[str, int]] = {}
    found: dict[str, list[int]] = {}
    for rank, prints in enumerate(every):
        for key, fp in prints.items():
            first = seen.setdefault(key, (fp, rank))
            if first[0] != fp:
                found.setdefault(key, [first[1]]).append(rank)
    return found


def refusal(step: int, found: dict[str, list[int]]) -> str:
    """The error's text for `divergent`'s findings: the fix that fits what differs comes
    first. Only an optimizer's param_groups differing (the model's names already apart, as
    pipeline stages with global names have them) leads with the mesh; model values under one
    name lead with the names."""
    keys = sorted(found)
    said = "; ".join(f"{k} (ranks {found[k][:6]})" for k in keys[:8])
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    what = (
        f"step {step}: ranks hold different values under the same name, which a checkpoint "
        f"would keep only one of (DCP saves a plain tensor or value that several ranks hold "
        f"once): {said}{more}; nothing was written."
    )
    names = (
        "Give each rank's distinct state its own name: pipeline stages keep the whole model's "
        "module names and hold only their own layers (replace the other stages' layers by "
        "nn.Identity(), or delete them from an nn.ModuleDict), and sharded state is a DTensor. "
        "Replicas (DDP) must hold the same bits: a difference there is a bug in the loop."
    )
    groups = [k for k in keys if k.startswith("optim.param_groups.")]
    if groups and not any(k.startswith("model.") for k in keys):
        return (
            "Pass the world mesh with a 'pp' dimension to track(mesh=...): the ranks' "
            "optimizers hold other parameters, as pipeline stages do, and with the mesh their "
            f"state is saved per parameter. {what} See docs/porting.md#pipelines."
        )
    mesh = (
        " Then pass the world mesh with a 'pp' dimension to track(mesh=...): an optimizer's "
        "param_groups that differ between ranks mean each rank optimizes other parameters, "
        "as pipeline stages do."
        if groups
        else ""
    )
    return f"{what} {names}{mesh} See docs/checkpoints.md#same-name."
