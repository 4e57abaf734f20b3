"""The complete training state as one DCP state dict, and how it is put back.

Layout (every top-level key is one DCP entry):
- "model", "optim": from torch.distributed.checkpoint.state_dict, so DDP, FSDP2 and a plain
  module share FQNs and DCP can reshard between world sizes.
- "common": one blob every rank has alike (step, scheduler, user extras); DCP keeps one copy.
- "rank<R>": one blob per rank (RNG states, dataloader position). Per-rank keys, because DCP
  keeps a single copy of anything saved under a shared key
  (docs/internals.md#g-dcp-replicated-keys).
Blobs are torch.save'd bytes read back with weights_only=True: plain data and tensors only.
An async save packs them on its own thread: `capture` takes what goes in them at call time,
`pack` makes the bytes later.
"""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from resilient.checkpoint._state_dicts import StateDicts
from resilient.checkpoint._torch_compat import FQNS_UNAVAILABLE, fqns_of, no_init_step

__all__ = [
    "StatefulLike",
    "TrainState",
    "Unpacked",
    "capture_rng",
    "flat_state_param",
    "pack",
    "restore_rng",
    "state_digest",
]


class StatefulLike(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A blob's content, captured but not yet torch.save'd (see `TrainState.capture`)."""

    obj: Any


def pack(sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` with every Unpacked entry torch.save'd into bytes, keys in the same order."""
    return {k: _pack(v.obj) if isinstance(v, Unpacked) else v for k, v in sd.items()}


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU, and CUDA where initialised."""
    py = random.getstate()
    np_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *[x for x in np_state[2:]]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy(), *n[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(kw_only=True, slots=True)
class TrainState:
    """What a checkpoint holds. `per_rank` and `common` objects need state_dict/load_state_dict."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    common: dict[str, StatefulLike] = field(default_factory=dict)
    """Identical on every rank: LR scheduler, grad scaler, user extras."""
    per_rank: dict[str, StatefulLike] = field(default_factory=dict)
    """Different on each rank: the dataloader position."""
    rng: bool = True
    """Save and restore per-rank RNG states (needed for bit-exact resume with dropout)."""
    layout: str = ""
    """The mesh layout's signature (resilient/mesh/): per-rank state loads rank by rank only
    onto the same world size and layout. "" for a flat data-parallel world."""
    pipeline: bool = False
    """A pipeline stage (a "pp" dimension in the mesh): the optimizer state is saved per
    parameter name (DCP's flatten_optimizer_state_dict), so that each stage's param_groups
    are keyed by its own parameters' global names and a checkpoint loads onto any split."""
    keep_names: bool = True
    """Keep DCP's parameter names between saves instead of resolving them on every save
    (checked against the live model and optimizer at each use: checkpoint/_state_dicts.py)."""
    _dicts: StateDicts = field(default_factory=StateDicts, init=False, repr=False, compare=False)
    _own: list[list[str]] | None = field(default=None, init=False, repr=False, compare=False)

    def optimizer_is_fresh(self) -> bool:
        """The tracked optimizer has no state yet (it has never stepped)."""
        return self.optimizer is not None and not self.optimizer.state

    def forget_failed_loads(self) -> None:
        """Empty the optimizer again after load attempts that all failed.

        Building a load template asks torch for the optimizer's state dict, which gives a
        fresh optimizer its state by running a zero-gradient step (AdamW: step 1, zero
        moments). A fresh start must begin from an empty optimizer, as an uninterrupted run
        does, or the bias correction differs from the first step on and the run is no longer
        bit-exact (docs/internals.md#g-optimizer-state-init)."""
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def unchecked(self) -> frozenset[str]:
        """Keys the save's same-name check leaves out (checkpoint/duplicates.py): a DDP
        model's buffers when DDP broadcasts them from rank 0 before each forward (BatchNorm's
        running statistics differ between replicas until then)."""
        m = self.model
        if isinstance(m, DistributedDataParallel) and m.broadcast_buffers:
            return frozenset(f"model.{name}" for name, _ in m.module.named_buffers())
        return frozenset()

    def to_state_dict(self, *, step: int, rank: int) -> dict[str, Any]:
        """The DCP state dict for a save after `step` steps. Tensors are live references."""
        return self._state_dict(step=step, rank=rank, later=False)

    def capture(self, *, step: int, rank: int) -> dict[str, Any]:
        """As `to_state_dict`, but the "common" and "rank<R>" entries may be `Unpacked`: copies
        of what goes in them, taken now, that training cannot change; `pack()` makes the bytes,
        on any thread. Model and optimizer tensors are live references, as there."""
        return self._state_dict(step=step, rank=rank, later=True)

    def _state_dict(self, *, step: int, rank: int, later: bool) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        if self.model is not None:
            osd: dict[str, Any] | None
            if self.pipeline and self.optimizer is not None:
                sd["model"], osd = get_state_dict(self.model, self.optimizer, options=_FLAT)
            else:
                sd["model"], osd = self._dicts.get(self.model, self.optimizer, keep=self.keep_names)
            if osd is not None:
                sd["optim"] = osd
        common = {"step": step, **{k: v.state_dict() for k, v in self.common.items()}}
        per_rank = {k: v.state_dict() for k, v in self.per_rank.items()}
        sd["common"] = _blob(common, later=later)
        # capture_rng() makes new objects: they go in after the copy, not through it
        sd[f"rank{rank}"] = _blob(per_rank, later=later, rng=capture_rng() if self.rng else None)
        return sd

    def load_template(
        self, *, rank: int, has_rank_blob: bool, flat_optim: bool = False
    ) -> dict[str, Any]:
        """A state dict for dcp.load to fill in place. `flat_optim`: the checkpoint's
        optimizer state is keyed per parameter (saved by pipeline stages)."""
        sd: dict[str, Any] = {}
        if self.model is not None:
            sd["model"] = get_model_state_dict(self.model)
            if self.optimizer is not None:
                opts = _FLAT if flat_optim else None
                sd["optim"] = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
                if not flat_optim:  # this rank's parameters of each group, before the load
                    self._own = [list(g["params"]) for g in sd["optim"]["param_groups"]]
        sd["common"] = b""
        if has_rank_blob:
            sd[f"rank{rank}"] = b""
        return sd

    def apply(self, sd: dict[str, Any], *, rank: int, flat_optim: bool | None = None) -> int:
        """Put a loaded state dict back into the live objects; returns the saved step.
        `flat_optim`: the optimizer state is keyed per parameter (None: as this state saves
        it, for a snapshot)."""
        flat_optim = self.pipeline if flat_optim is None else flat_optim
        if self.model is not None:
            set_model_state_dict(self.model, sd["model"])
            if self.optimizer is not None:
                osd = sd["optim"]
                if not flat_optim and self._own is not None:
                    # a checkpoint of the whole model loaded into one pipeline stage: each
                    # group keeps the parameters this stage holds (a no-op otherwise)
                    for g, own in zip(osd["param_groups"], self._own, strict=False):
                        g["params"] = [p for p in g["params"] if p in set(own)]
                fqns = _fqn_by_param(self.model, self.optimizer)
                flat = _flat_state(osd, set(fqns.values())) if flat_optim else None
                names = None
                if flat is not None:  # each parameter's state names, for the placeholders
                    names = {
                        p: sorted({k.split(".")[0] for k in flat[f]})
                        for p, f in fqns.items()
                        if f in flat
                    }
                with no_init_step(self.optimizer, names):  # no zero-gradient step: see there
                    set_optimizer_state_dict(
                        self.model, self.optimizer, osd, options=_FLAT if flat_optim else None
                    )
                _check_optimizer_loaded(self.optimizer, osd, fqns, flat)
        common = _unpack(sd["common"])
        for k, obj in self.common.items():
            if k in common:
                obj.load_state_dict(common[k])
        blob = sd.get(f"rank{rank}")
        if blob:
            per_rank = _unpack(blob)
            for k, obj in self.per_rank.items():
                if k in per_rank:
                    obj.load_state_dict(per_rank[k])
            if self.rng and "__rng__" in per_rank:
                restore_rng(per_rank["__rng__"])
        return int(common["step"])


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _fqn_by_param(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, str]:
    """The DCP name of each parameter the optimizer steps ({} on a torch that cannot say)."""
    if FQNS_UNAVAILABLE:
        return {}
    by_param = {p: name for name, p in model.named_parameters()}
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p in by_param:
                out[p] = min(fqns_of(model, by_param[p]))
    return out


def flat_state_param(key: str, fqns: Collection[str]) -> str | None:
    """The parameter a flattened optimizer key "state.<fqn>.<name>" (a nested value's name
    followed by its own keys) belongs to: the longest of `fqns` it names, None if none.
    Tries the key's dotted prefixes, so a whole state dict is read in one pass."""
    parts = key.split(".")[1:]
    for i in range(len(parts) - 1, 0, -1):
        fqn = ".".join(parts[:i])
        if fqn in fqns:
            return fqn
    return None


def _flat_state(osd: dict[str, Any], fqns: Collection[str]) -> dict[str, list[str]]:
    """A flattened optimizer state dict's state keys by parameter: {fqn: ["<name>", ...]}
    (the key less "state.<fqn>."), in one pass."""
    out: dict[str, list[str]] = {}
    for k in osd:
        fqn = flat_state_param(k, fqns) if k.startswith("state.") else None
        if fqn is not None:
            out.setdefault(fqn, []).append(k[len(f"state.{fqn}.") :])
    return out


def _leaves(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(_leaves(v) for v in obj.values())
    return 1


def _check_optimizer_loaded(
    optimizer: torch.optim.Optimizer,
    osd: dict[str, Any],
    fqns: dict[torch.Tensor, str],
    flat: dict[str, list[str]] | None,
) -> None:
    """RuntimeError when a parameter's optimizer state in `osd` did not arrive in the
    optimizer: the run would go on from other moments than the saved run, not bit for bit.
    `flat`: the flattened format's keys by parameter (`_flat_state`), None for the nested."""
    for p, fqn in fqns.items():
        if flat is not None:
            want = len(flat.get(fqn, ()))
        else:
            want = _leaves(osd["state"][fqn]) if fqn in osd.get("state", {}) else 0
        got = _leaves(optimizer.state[p]) if p in optimizer.state else 0
        if got != want:
            raise RuntimeError(
                f"the optimizer state of {fqn!r} was not loaded: {want} values saved, "
                f"{got} in the optimizer after the load; continuing would not be bit for bit"
            )


def _blob(obj: dict[str, Any], *, later: bool, rng: Any = None) -> Any:
    """A blob's bytes now, or (`later`) an Unpacked deep copy: state_dict() may hand out live
    objects (a scheduler's lists, a loader's nested state) that training changes meanwhile."""
    if later:
        try:
            obj = copy.deepcopy(obj)
        except Exception:  # not copyable, though torch.save may manage: packed now
            later = False
    if rng is not None:
        obj["__rng__"] = rng
    return Unpacked(obj) if later else _pack(obj)


class Extra:
    """Wraps get/set callables as a Stateful, for user extras that are plain values."""

    def __init__(self, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        self._get, self._set = get, set

    def state_dict(self) -> dict[str, Any]:
        return {"value": self._get()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._set(state_dict["value"])


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """sha256 over the full (unsharded) model and optimizer state, equal on every rank.

    A collective under DDP/FSDP: every rank must call it. Used to prove bit-exact resume.
    """
    import hashlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    h = hashlib.sha256()
    items: list[tuple[str, Any]] = sorted(get_model_state_dict(model, options=opts).items())
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=opts)
        items += _flatten("optim", osd)
    for key, val in items:
        h.update(key.encode())
        if isinstance(val, torch.Tensor):
            t = val.full_tensor() if hasattr(val, "full_tensor") else val
            t = t.detach().cpu().contiguous()
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(val).encode())
    return h.hexdigest()


def _flatten(prefix: str, obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        out: list[tuple[str, Any]] = []
        for k in sorted(obj, key=str):
            out += _flatten(f"{prefix}.{k}", obj[k])
        return out
    if isinstance(obj, list | tuple):
        out = []
        for i, v in enumerate(obj):
            out += _flatten(f"{prefix}[{i}]", v)
        return out
    return [(prefix, obj)]
