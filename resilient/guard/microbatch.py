"""Micro-batches: a batch split into slices, retried in twice as many on an OOM.

    for mb in rt.micro_batches(x, y, model=model):     # DDP: an OOM retries the same batch
        with mb:                                       # in smaller micro-batches
            _, loss = model(*mb.inputs)
            mb.backward(loss)
    optimizer.step()

`MicroBatches` slices the batch and runs attempts over it; each attempt agrees once across
ranks (attempt.py says how, and why it cannot deadlock). On an agreed OOM it restores the
RNG and the gradients, so the retry produces what a run with the smaller micro-batches would
have, and doubles the split, which the guard carries to later attempts (guard.py). A module
of its own because the guard's failure agreement (guard.py) needs none of this machinery.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from resilient.errors import ConfigError
from resilient.groups._torch_compat import has_python_comm_hook
from resilient.groups.ddp import reset_reducer
from resilient.guard.attempt import OK, ROLLBACK, Attempt, Guard, Retry
from resilient.hang.phases import FLAG_FAILED, FLAG_OOM, Phase

__all__ = ["MicroBatch", "MicroBatches"]


class MicroBatches:
    """The micro-batch iteration of one Guard (its `micro_batches`), with what it keeps from
    one batch to the next: the trainable parameters and sentinel of each DDP model, and
    where the agreement happens."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._params: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self._sentinels: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self._beside_backward = False
        """The body was seen calling `mb.backward` on its last micro-batch (every rank runs
        the same body, so every rank learns it at the same agreed attempt): from then on the
        agreement is folded into the synced backward, or rides beside it (attempt.py)."""

    def _trainable(self, model: nn.Module | None) -> list[torch.Tensor]:
        """The parameters whose gradients a retry restores. Walking the module tree costs
        about half of micro_batches' own time on a small model, so for a DDP module, whose
        parameters are fixed at its construction, the list is kept."""
        if model is None:
            return []
        if not isinstance(model, DistributedDataParallel):
            return [p for p in model.parameters() if p.requires_grad]
        params = self._params.get(model)
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
            self._params[model] = params
        return params

    def _sentinel(self, model: nn.Module | None) -> torch.Tensor | None:
        """The parameter whose reduced gradient carries a folded agreement (attempt.py), or
        None where the agreement cannot be folded: gradients off the CPU (reading one would
        wait for the device) or a Python comm hook (it might not carry a NaN through).
        Every rank decides alike: DDP requires the same parameters and hooks on all."""
        if not isinstance(model, DistributedDataParallel) or has_python_comm_hook(model):
            return None
        found = self._sentinels.get(model)
        if found is None:
            ignored = model.parameters_to_ignore
            param = next(
                (
                    p
                    for name, p in model.module.named_parameters()
                    if p.requires_grad and p.numel() and name not in ignored
                ),
                None,
            )
            usable = param is not None and param.device.type == "cpu" and not param.is_sparse
            found = [param] if usable and param is not None else []
            self._sentinels[model] = found
        return found[0] if found else None

    def iterate(
        self, tensors: tuple[torch.Tensor, ...], model: nn.Module | None, split: int | None
    ) -> Iterator[MicroBatch]:
        """Guard.micro_batches (guard.py says what it yields and promises)."""
        g = self.guard
        if not tensors:
            raise ConfigError("micro_batches() needs at least one tensor (the batch)")
        n = len(tensors[0])
        if n < 1 or any(len(t) != n for t in tensors):
            raise ConfigError(
                f"micro_batches(): every tensor needs the same, non-zero size along dim 0; "
                f"got {[len(t) for t in tensors]}"
            )
        if split is not None:
            if split < 1:
                raise ConfigError(f"split must be >= 1, got {split}")
            g.split = max(g.split, split)
        in_place = g.ctx.world_size == 1 or isinstance(model, DistributedDataParallel)
        can_fold = (
            g.ctx.distributed
            and isinstance(model, DistributedDataParallel)
            and not model.find_unused_parameters
        )
        params = self._trainable(model)
        sentinel = self._sentinel(model) if can_fold and self._beside_backward else None
        while True:
            k = max(1, min(g.split, n))
            chunks = [t.tensor_split(k) for t in tensors]
            grads_none = all(p.grad is None for p in params)
            rng = _rng_state()
            att = Attempt(
                g,
                k,
                n,
                model,
                in_place,
                beside=can_fold and self._beside_backward,
                sentinel=sentinel,
            )
            for i in range(k):
                part = tuple(c[i] for c in chunks)
                yield MicroBatch(att, i, part, len(part[0]) / n)
                if att.agreed or att.pending is not None:  # the last one, or this rank failed
                    break
            if att.pending is not None:  # failed, folded or beside: join the peers' backward
                att.join_backward()
            elif not att.agreed:  # the body never called mb.backward: agree here
                att.agree(OK)
            if att.outcome == OK:
                if can_fold and att.synced_backward:
                    self._beside_backward = True
                return
            _set_rng_state(rng)
            for p in params:
                if grads_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            if isinstance(model, DistributedDataParallel):
                # Healthy ranks ran the last micro-batch's synced forward, which armed DDP's
                # reducer for a backward that never came; the failing rank's did not. Disarm
                # it on every rank alike (DDP's own _update_process_group does the same), or
                # the next no_sync backward would all-reduce on some ranks only.
                reset_reducer(model)  # keeps a pinned bucket layout (groups/ddp.py)
                model.require_forward_param_sync = True  # as after any step's synced forward
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            g.watchdog.progress.flags &= ~(FLAG_FAILED | FLAG_OOM)
            if att.outcome == ROLLBACK:  # the Runtime restores the snapshot after the body
                return
            g.split = 2 * k
            fields = {
                "step": g.watchdog.progress.step,
                "failed_rank": att.failed_rank,
                "split_from": k,
                "split_to": g.split,
                "micro_batch_size": math.ceil(n / g.split),
                "agreed": att.where,
            }
            if g.ctx.rank == 0:
                g.log.warning("oom.retry", **fields)
            else:
                g.log.info("oom.retry", **fields)
            g.carry(g.split, reason="oom", rank=att.failed_rank)


class MicroBatch:
    """One slice of the batch. `inputs` holds the slices of the tensors given, in order."""

    __slots__ = ("_att", "index", "inputs", "weight")

    def __init__(self, att: Attempt, index: int, inputs: tuple[Any, ...], weight: float) -> None:
        self._att = att
        self.index = index
        self.inputs = inputs
        self.weight = weight
        """This micro-batch's share of the batch (its samples / the batch's samples)."""

    @property
    def count(self) -> int:
        """Micro-batches in this attempt."""
        return self._att.k

    @property
    def last(self) -> bool:
        return self.index == self._att.k - 1

    def __enter__(self) -> MicroBatch:
        self._att.enter_sync(self.last)
        return self

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` scaled by `weight`; the last micro-batch first agrees with the
        other ranks (a control-group all-reduce) and then runs the gradient sync."""
        att = self._att
        scaled = loss if att.k == 1 else loss * self.weight
        if not self.last:
            scaled.backward()
            return
        att.synced_backward = True
        if att.sentinel is not None:
            att.agreed = True  # peers are in the gradient all-reduce: a failure from here
            att.guard.watchdog.progress.enter(Phase.BACKWARD)  # on takes the store path
            scaled.backward()
            if att.gradients_finite():
                att.outcome = OK
                return
            att.agree(OK)  # a failed rank's NaN, or gradients not finite by themselves
            if att.outcome != OK:
                raise Retry  # the reduced gradients include a failed rank's NaN: redo
            g = att.guard
            g.log.info("guard.nonfinite_gradients", step=g.watchdog.progress.step)
            return
        if att.beside:
            att.launch(OK)
            att.guard.watchdog.progress.enter(Phase.BACKWARD)
            scaled.backward()
            att.finish()
            if att.outcome != OK:
                raise Retry  # the reduced gradients include a failed rank's zeros: redo
            return
        att.agree(OK)
        if att.outcome != OK:
            raise Retry
        att.guard.watchdog.progress.enter(Phase.BACKWARD)
        scaled.backward()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self._att.exit_sync()
        if exc is None:
            return False
        if isinstance(exc, Retry):
            return True
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not ours to judge
        self._att.failed(exc, self.index)
        return True


def _rng_state() -> tuple[torch.Tensor, Any]:
    cuda = (
        torch.cuda.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, Any]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
