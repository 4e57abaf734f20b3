"""The model and optimizer state dicts DCP builds, without redoing its name mapping each save.

get_model_state_dict and get_optimizer_state_dict map every parameter and state-dict key to
its FQN on every call (_verify_options walks the modules and resolves each name, then each
key is resolved again): most of their cost, and the same answer every time while the model
and the optimizer stay as they are. `StateDicts` keeps that answer between calls: names and
object ids only, never a tensor. The tensors are taken afresh from `model.state_dict()` and
`optimizer.state_dict()` on every call, exactly the calls DCP makes, so a replaced parameter
or optimizer state is saved as it is now; the kept names are only used after a check against
the live objects (`_signature`): the model and the optimizer, every module (name, identity,
type), every parameter (name, identity), every param group's parameters, the state-dict keys.
On any difference the call goes to DCP as before, and the names are resolved again.

Comparing ids is enough: every id compared belongs to an object alive at that moment, and the
names only depend on which live object sits where (a module's type decides what DCP strips
from a key, `module.` under DDP). Two objects alive together never share an id; a new object
that took a freed one's id at the same place gets the same name, which is then right.

Kept only where DCP itself does nothing but rename: a plain module, DDP or FSDP2
(fully_shard), default StateDictOptions. FSDP1, a state_dict replaced on the instance (DCP's
own patching does that), and an optimizer with no state yet (DCP steps it first) always take
DCP's path. When the names are resolved, the result is checked once against DCP's own output
of the same call; a torch whose DCP does more than rename is found there, and is never cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel

from resilient.checkpoint import _torch_compat
from resilient.log import get_logger

__all__ = ["StateDicts"]

_EVENT = "ckpt.state_dict.uncached"


def _signature(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, ...]:
    """What the kept names depend on, as live object ids (see the module's docstring)."""
    return (
        id(model),
        id(optimizer),
        tuple((name, id(m), type(m)) for name, m in model.named_modules()),
        tuple((name, id(p)) for name, p in model.named_parameters()),
        None
        if optimizer is None
        else tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups),
    )


def _one(fqns: set[str]) -> str | None:
    return next(iter(fqns)) if len(fqns) == 1 else None


@dataclass(frozen=True, slots=True)
class _Names:
    signature: tuple[Any, ...]
    keys: frozenset[str]
    """model.state_dict()'s keys."""
    renames: dict[str, str]
    """The keys DCP renames, to their FQN (DDP's `module.` prefix goes)."""
    by_pid: tuple[str, ...]
    """The FQN of each parameter of the optimizer's param_groups, in their order."""

    def model(self, sd: dict[str, Any]) -> dict[str, Any] | None:
        """`model.state_dict()` renamed as DCP's _get_model_state_dict renames it, in place;
        None when its keys are not the kept ones."""
        if sd.keys() != self.keys:
            return None
        for key in list(sd):  # renamed keys move to the end, as in DCP
            fqn = self.renames.get(key)
            if fqn is not None:
                sd[fqn] = sd.pop(key)
        return sd

    def optimizer(self, osd: dict[str, Any]) -> dict[str, Any] | None:
        """`optimizer.state_dict()` renamed as DCP's _get_optim_state_dict renames it (for a
        module that is not FSDP1); None when its state is not keyed by the kept positions."""
        state, groups = osd["state"], osd["param_groups"]
        if not all(type(k) is int and 0 <= k < len(self.by_pid) for k in state):
            return None
        for k in list(state):
            state[self.by_pid[k]] = state.pop(k)
        for g in groups:
            g["params"] = [self.by_pid[i] for i in g["params"]]
        return {"state": dict(state), "param_groups": list(groups)}


def _model_sd(model: nn.Module) -> dict[str, Any]:
    with torch.no_grad():  # as DCP calls it
        return model.state_dict()


class StateDicts:
    """get_model_state_dict and get_optimizer_state_dict of one TrainState, with the names
    kept between calls (the module's docstring says when, and why it cannot go stale)."""

    def __init__(self) -> None:
        self._names: _Names | None = None
        self._logged: str | None = _torch_compat.FQNS_UNAVAILABLE
        if self._logged is not None:
            get_logger().info(_EVENT, reason=self._logged)

    @property
    def kept(self) -> bool:
        """Names are kept now: the next call checks them instead of asking DCP."""
        return self._names is not None

    def get(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, keep: bool = True
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(model state dict, optimizer state dict or None), as DCP's public calls give them;
        `keep=False`: from DCP's public calls, and the kept names are dropped."""
        if not keep or _torch_compat.FQNS_UNAVAILABLE is not None:
            self._names = None
            return _dcp(model, optimizer)
        if optimizer is not None and not optimizer.state:
            return _dcp(model, optimizer)
        signature = _signature(model, optimizer)
        names = self._names
        if names is not None and names.signature == signature:
            msd = names.model(_model_sd(model))
            osd = None if optimizer is None else names.optimizer(optimizer.state_dict())
            if msd is not None and (optimizer is None or osd is not None):
                return msd, osd
        msd, osd = _dcp(model, optimizer)
        self._names, why = _resolve(signature, model, optimizer, msd, osd)
        if why != self._logged:  # once per reason, not once per save
            self._logged = why
            if why is not None:
                get_logger().info(_EVENT, reason=why)
        return msd, osd


def _dcp(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)  # one _verify_options for both, not two


def _resolve(
    signature: tuple[Any, ...],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    msd: dict[str, Any],
    osd: dict[str, Any] | None,
) -> tuple[_Names | None, str | None]:
    """The names DCP gave in (msd, osd), or None and why they cannot be kept."""
    if FullyShardedDataParallel.fsdp_modules(model):
        return None, "FSDP1 (FullyShardedDataParallel): its state dicts are not renames"
    if "state_dict" in vars(model) or (optimizer is not None and "state_dict" in vars(optimizer)):
        return None, "state_dict replaced on the instance"
    fqns = _torch_compat.fqns_of
    bare = _model_sd(model)
    renames: dict[str, str] = {}
    for key in bare:
        fqn = _one(fqns(model, key))
        if fqn is None:
            return None, f"state-dict key {key!r} has no single FQN"
        if fqn != key:
            renames[key] = fqn
    by_pid: list[str] = []
    if optimizer is not None:
        by_param = {id(p): _one(fqns(model, name)) for name, p in model.named_parameters()}
        for p in chain.from_iterable(g["params"] for g in optimizer.param_groups):
            fqn = by_param.get(id(p))
            if fqn is None:
                return None, "an optimizer parameter is not a parameter of the model"
            by_pid.append(fqn)
    names = _Names(signature=signature, keys=frozenset(bare), renames=renames, by_pid=tuple(by_pid))
    # The same call through the kept names must give what DCP gave.
    mine = names.model(bare)
    if mine is None or list(mine) != list(msd):
        return None, "model state-dict keys differ from DCP's (torch changed?)"
    if optimizer is not None:
        assert osd is not None
        mine = names.optimizer(optimizer.state_dict())
        if (
            mine is None
            or list(mine["state"]) != list(osd["state"])
            or [g["params"] for g in mine["param_groups"]]
            != [g["params"] for g in osd["param_groups"]]
        ):
            return None, "optimizer state-dict names differ from DCP's (torch changed?)"
    return names, None
