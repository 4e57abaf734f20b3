"""The OOM/exception guard: one rank's failure becomes one action that every rank agrees on.

Two forms, for the body of a training step:

    with rt.guard():                                   # any exception: the group exits together
        _, loss = model(x, y)
        loss.backward()

    for mb in rt.micro_batches(x, y, model=model):     # DDP: an OOM retries the same batch
        with mb:                                       # in smaller micro-batches
            _, loss = model(*mb.inputs)
            mb.backward(loss)
    optimizer.step()

Why this never deadlocks. A rank that raises must not wait where its peers cannot come:
- `rt.guard()`, and FSDP or any model that may hold collectives inside its forward: the
  failing rank publishes a verdict through the store; every rank's watchdog thread, which
  never joins a collective, carries it out (os._exit) within one heartbeat interval, also on
  ranks blocked in a collective. No collective is needed to agree. Under hot recovery the
  failing rank leaves alone instead and is replaced warm (runtime/hot.py,
  leave_for_replacement); the same failure again at the same step takes the verdict.
- `micro_batches` with DDP: DDP's forward holds no collective once the first micro-batch
  started (its buffer broadcast comes first; micro-batches but the last run under no_sync;
  its one bucket rebuild is done at track() and after a reset, runtime/_ddp.py), and
  no_sync backwards hold none. The only gradient all-reduce is the last micro-batch's
  backward. Every attempt agrees exactly once on every rank: through a vote, an
  all_reduce(MAX) of a status code on the control group, or, folded into the gradient
  all-reduce, through its result alone (below). All OK: the step goes on. An OOM: every rank
  restores the RNG and gradients and retries the same batch in twice as many micro-batches.
  Anything else, or the floor reached: every rank exits with the same code (or rolls back,
  runtime/snapshot.py). A failure *after* the agreement started (inside the synced
  backward) takes the store path above, since peers may be blocked in the all-reduce.
  Where the agreement happens:
  - *Folded into the gradient all-reduce* (the usual case on CPU, from a batch's second
    attempt on: once this body was seen calling `mb.backward` on its last micro-batch, with
    DDP, find_unused_parameters=False, CPU gradients and no Python comm hook). Healthy ranks
    hold no vote of their own: a failing rank, after its `with mb:` block (the failed
    forward's memory is released by then), joins the backward's gradient all-reduce with
    every bucket filled with NaN (the reducer's own join mechanism,
    runtime/_torch_compat.py), so every rank's reduced gradients are NaN. After the synced
    backward each rank reads one element of one gradient: finite, the step goes on, at the
    cost of that read. Not finite (a failure, or gradients that overflowed by themselves):
    every rank, the failing one included, holds the vote, which tells the two apart; the
    reduced gradients are thrown away on a retry.
  - *Beside the backward* (the same, with gradients on an accelerator, where reading one
    element would wait for the device, or with a Python comm hook, which might not carry a
    NaN through): healthy ranks start the vote asynchronously in `mb.backward` and wait for
    it after the synced backward, so it costs a launch, not a round trip. A failing rank
    starts the same vote and joins the gradient all-reduce as above.
  - *Before the backward* (the first attempt of the first batch, other DDP settings): the
    agreement blocks in `mb.backward` before the synced backward runs, and a failing rank
    arrives from its `with mb:` exit. A body that never calls `mb.backward` agrees at
    the end of its micro-batches.
- If a user's body holds a collective of its own after the failure point, the agreement
  cannot complete; the failing rank is flagged in its heartbeat, stalls in phase `agree`,
  and the hang monitor takes the group down with the OOM/exception code at its timeout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.log import get_logger
from resilient.runtime._ddp import reset_reducer
from resilient.runtime._torch_compat import (
    has_python_comm_hook,
    is_peer_loss_message,
    match_backward_all_reduce,
)
from resilient.runtime.dist import DistContext
from resilient.runtime.heartbeat import FLAG_FAILED, FLAG_OOM, Phase
from resilient.runtime.watchdog import Watchdog, exit_now

__all__ = ["Guard", "MicroBatch"]

_OK, _OOM, _EXC = 0, 1, 2
_ROLLBACK = 3  # an outcome only: every rank rolls back in place (runtime/snapshot.py)
_LOW = 0xFFFFFFFF
_SPLIT_KEY = "resilient/guard/split"
SPLIT_FILE = "micro_batch_split.json"
"""Written to the run directory when the split grows, read by the next attempt."""


class _Retry(Exception):
    """Raised in the last micro-batch of healthy ranks when the group agreed to retry."""


def _classify(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    # A failing collective after a peer died or hung: not this rank's fault. The monitor
    # names the culprit; this rank only waits for its verdict.
    if isinstance(exc, dist.DistError) or is_peer_loss_message(str(exc)):
        return "peer"
    return "exception"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:500]}"


class Guard:
    """Created by the Runtime; reached through `rt.guard()` and `rt.micro_batches()`."""

    def __init__(self, watchdog: Watchdog, ctx: DistContext, run_dir: str) -> None:
        self.watchdog = watchdog
        self.ctx = ctx
        self.config = watchdog.config
        self.split = 1
        """Micro-batches per batch; grows on OOM and stays grown (also across restarts)."""
        self._path = Path(run_dir) / SPLIT_FILE
        self._log = get_logger()
        self.failing = False
        """In fail_fast: a stop signal from the launcher now means "leave", not "save"."""
        self.rollback: Callable[[int, int], bool] | None = None
        """Set by the Runtime when snapshots are on: called on every rank with (step, failed
        rank) once the in-place agreement found an exception; True: roll back, not exit."""
        self.hot: Callable[[BaseException], NoReturn] | None = None
        """Set by the Runtime under hot recovery: a lost peer re-runs the script in place
        (runtime/hot.py) instead of taking the group down."""
        self.hot_own: Callable[[BaseException, str, int], None] | None = None
        """Set by the Runtime under hot recovery: this rank's own failure (kind, split) outside
        the in-place agreement leaves this process alone, to be replaced hot
        (hot.leave_for_replacement: exits), or returns when the group must go cold."""
        self.stop_requested: Callable[[], bool] = lambda: False
        """Set by the Runtime: has a stop (preemption) signal arrived? Then a lost peer means
        the launcher is already taking the group down, and no verdict is worth waiting for."""
        self._params: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self._sentinels: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self._beside_backward = False
        """The body was seen calling `mb.backward` on its last micro-batch (every rank runs
        the same body, so every rank learns it at the same agreed attempt): from then on the
        agreement is folded into the synced backward, or rides beside it (module doc)."""

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
        """The parameter whose reduced gradient carries a folded agreement (module doc), or
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

    # ------------------------------------------------------------------ carried split
    def resume_split(self) -> int:
        """Adopt the split an earlier attempt carried over (max over ranks: a collective)."""
        split = 1
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            split = max(split, int(json.loads(self._path.read_text())["split"]))
        store = self.ctx.base_store
        if store is not None and store.check([_SPLIT_KEY]):
            split = max(split, int(store.get(_SPLIT_KEY)))
        if self.ctx.distributed:
            t = torch.tensor([split], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.control_group)
            split = int(t.item())
        self.split = split
        if split > 1:
            self._log.info("guard.split", split=split, source="carried from an earlier attempt")
        return split

    def _carry(self, split: int, **why: Any) -> None:
        """Make `split` the starting point of later attempts (store: all nodes; file: record)."""
        record = {"split": split, "step": self.watchdog.progress.step, **why}
        store = self.ctx.base_store
        with contextlib.suppress(dist.DistError, RuntimeError):
            if store is not None:
                store.set(_SPLIT_KEY, str(split))
        if self.ctx.local_rank == 0 or why.get("rank") == self.ctx.rank:
            tmp = self._path.with_name(f".{SPLIT_FILE}.{self.ctx.rank}.tmp")
            with contextlib.suppress(OSError):
                self._path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(record))
                os.replace(tmp, self._path)

    # ------------------------------------------------------------------ the guards
    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any exception in the block takes the whole group down with one agreed exit code
        (OOM or RANK_EXCEPTION; PEER_LOST when the error came from a lost peer)."""
        try:
            yield
        except Exception as e:
            self.fail_fast(e)

    def on_uncaught(self, exc: BaseException) -> None:
        """An exception that escaped the training loop (the Runtime's excepthook). A collective
        that failed because a peer is gone is not this rank's failure: it gets the guard's
        treatment, as if the loop had been guarded (the monitor names the lost rank, every
        rank exits PEER_LOST). Under hot recovery the rank's own exception is treated like a
        guarded one. Anything else returns and is recorded as the rank's own."""
        if not self.ctx.distributed or self.failing:
            return
        if self.hot_own is not None or _classify(exc) == "peer":
            self.fail_fast(exc)

    def fail_fast(self, exc: BaseException) -> NoReturn:
        """Log `exc`, publish a verdict naming this rank and exit with every other rank."""
        wd = self.watchdog
        if wd.verdict_pending():
            wd.wait_for_verdict(1.0)
        kind = _classify(exc)
        step, phase = wd.progress.step, wd.progress.phase.name.lower()
        if kind != "peer":  # this rank's own failure
            hot_own = None if self.stop_requested() else self.hot_own
            self._log.error(
                "guard.failure",
                kind=kind,
                step=step,
                phase=phase,
                error=_short(exc),
                exc_info=exc,
                **({"action": "hot replacement"} if hot_own is not None else {}),
            )
            if kind == "oom":  # the next attempt, or generation, starts at twice the split
                self._carry(self.split * 2, reason="oom", rank=self.ctx.rank)
            if hot_own is not None:
                hot_own(exc, kind, self.split)  # exits this process alone, or: cold
        self.failing = True
        if kind == "peer":
            self._log.warning("guard.peer_error", step=step, phase=phase, error=_short(exc))
            if self.hot is not None and not self.stop_requested():
                self.failing = False
                self.hot(exc)  # raises HotRestart, or exits cold with a reason
            if self.stop_requested():
                exit_now(ExitCode.PEER_LOST, kind="peer_lost", reason="stopped by the launcher")
            cfg = self.config
            wd.wait_for_verdict(cfg.heartbeat_timeout_s + 2 * cfg.heartbeat_interval_s + 1)
            wd.abort(
                kind="peer_lost",
                code=ExitCode.PEER_LOST,
                ranks=[],
                reason=f"rank {self.ctx.rank} at step {step} ({phase}): {_short(exc)}",
                expect_acks=self.ctx.world_size - 1,
            )
        oom = kind == "oom"
        wd.report_failure(oom=oom)
        wd.abort(
            kind="failure",
            code=ExitCode.OOM if oom else ExitCode.RANK_EXCEPTION,
            ranks=[self.ctx.rank],
            reason=f"{_short(exc)} on rank {self.ctx.rank} at step {step} ({phase})",
        )

    def micro_batches(
        self, *tensors: torch.Tensor, model: nn.Module | None = None, split: int | None = None
    ) -> Iterator[MicroBatch]:
        """Split `tensors` (one batch, along dim 0) into micro-batches, retrying on OOM.

        Enter each yielded MicroBatch with `with` and call `mb.backward(loss)` with the
        micro-batch's mean loss (it is scaled by the micro-batch's share of the batch, so the
        gradients match the whole batch's). With a DDP `model` an OOM on any rank makes every
        rank retry the same batch in twice as many micro-batches, down to
        `min_micro_batch_size` samples, then exit with ExitCode.OOM; the RNG and gradients
        are restored first, so the result is the one a run with the smaller split would
        have produced. Without DDP (FSDP, or no model), any failure exits the group and the
        larger split is carried to the next attempt. `split`: the least number of
        micro-batches. Gradients must be zero or None when the step starts.
        """
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
            self.split = max(self.split, split)
        in_place = self.ctx.world_size == 1 or isinstance(model, DistributedDataParallel)
        can_fold = (
            self.ctx.distributed
            and isinstance(model, DistributedDataParallel)
            and not model.find_unused_parameters
        )
        params = self._trainable(model)
        sentinel = self._sentinel(model) if can_fold and self._beside_backward else None
        while True:
            k = max(1, min(self.split, n))
            chunks = [t.tensor_split(k) for t in tensors]
            grads_none = all(p.grad is None for p in params)
            rng = _rng_state()
            att = _Attempt(
                self,
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
                att.agree(_OK)
            if att.outcome == _OK:
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
                reset_reducer(model)  # keeps a pinned bucket layout (runtime/_ddp.py)
                model.require_forward_param_sync = True  # as after any step's synced forward
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            self.watchdog.progress.flags &= ~(FLAG_FAILED | FLAG_OOM)
            if att.outcome == _ROLLBACK:  # the Runtime restores the snapshot after the body
                return
            self.split = 2 * k
            fields = {
                "step": self.watchdog.progress.step,
                "failed_rank": att.failed_rank,
                "split_from": k,
                "split_to": self.split,
                "micro_batch_size": math.ceil(n / self.split),
                "agreed": att.where,
            }
            if self.ctx.rank == 0:
                self._log.warning("oom.retry", **fields)
            else:
                self._log.info("oom.retry", **fields)
            self._carry(self.split, reason="oom", rank=att.failed_rank)


class MicroBatch:
    """One slice of the batch. `inputs` holds the slices of the tensors given, in order."""

    __slots__ = ("_att", "index", "inputs", "weight")

    def __init__(self, att: _Attempt, index: int, inputs: tuple[Any, ...], weight: float) -> None:
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
                att.outcome = _OK
                return
            att.agree(_OK)  # a failed rank's NaN, or gradients not finite by themselves
            if att.outcome != _OK:
                raise _Retry  # the reduced gradients include a failed rank's NaN: redo
            g = att.guard
            g._log.info("guard.nonfinite_gradients", step=g.watchdog.progress.step)
            return
        if att.beside:
            att.launch(_OK)
            att.guard.watchdog.progress.enter(Phase.BACKWARD)
            scaled.backward()
            att.finish()
            if att.outcome != _OK:
                raise _Retry  # the reduced gradients include a failed rank's zeros: redo
            return
        att.agree(_OK)
        if att.outcome != _OK:
            raise _Retry
        att.guard.watchdog.progress.enter(Phase.BACKWARD)
        scaled.backward()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self._att.exit_sync()
        if exc is None:
            return False
        if isinstance(exc, _Retry):
            return True
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not ours to judge
        self._att.failed(exc, self.index)
        return True


class _Attempt:
    """One pass over the micro-batches of a batch; agrees exactly once."""

    def __init__(
        self,
        guard: Guard,
        k: int,
        n: int,
        model: nn.Module | None,
        in_place: bool,
        *,
        beside: bool = False,
        sentinel: torch.Tensor | None = None,
    ) -> None:
        self.guard = guard
        self.k = k
        self.n = n
        self.model = model
        self.in_place = in_place
        self.beside = beside
        """Agree beside the synced backward rather than before it (module doc)."""
        self.sentinel = sentinel
        """Set: the agreement is folded into the synced backward; this parameter's reduced
        gradient says whether any rank failed (module doc)."""
        self.agreed = False
        """The agreement has started on this rank (a failure after it takes the store path)."""
        self.pending: int | None = None
        """Beside the backward: this rank failed with this status; it agrees and joins the
        peers' backward once its `with mb:` block has been left."""
        self.synced_backward = False
        """`mb.backward` was called on the last micro-batch."""
        self.outcome: int | None = None
        self.failed_rank = -1
        self._sync: Any = None
        self._vote: torch.Tensor | None = None
        self._work: Any = None

    def enter_sync(self, last: bool) -> None:
        if self.k == 1 or self.model is None:
            return
        if isinstance(self.model, DistributedDataParallel):
            if not last:  # DDP decides in forward whether the backward syncs
                self._sync = self.model.no_sync()
                self._sync.__enter__()
        else:
            set_sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2
            if set_sync is not None:
                set_sync(last)

    def exit_sync(self) -> None:
        if self._sync is not None:
            sync, self._sync = self._sync, None
            sync.__exit__(None, None, None)

    def failed(self, exc: Exception, index: int) -> None:
        """This rank raised inside a micro-batch: agree on the action, or take the store path."""
        g = self.guard
        kind = _classify(exc)
        if kind == "peer" or not self.in_place or self.agreed:
            g.fail_fast(exc)
        wd = g.watchdog
        oom = kind == "oom"
        g._log.error(
            "guard.failure",
            kind=kind,
            step=wd.progress.step,
            phase=wd.progress.phase.name.lower(),
            micro_batch=index,
            micro_batches=self.k,
            error=_short(exc),
            exc_info=exc,
        )
        wd.report_failure(oom=oom)
        if self.beside:
            self.pending = _OOM if oom else _EXC
            return
        self.agree(_OOM if oom else _EXC)

    @property
    def where(self) -> str:
        """Where this attempt's agreement happens, as the `oom.retry` event says it."""
        if self.sentinel is not None:
            return "folded into the gradient all-reduce"
        return "beside the backward" if self.beside else "before the backward"

    def gradients_finite(self) -> bool:
        """The folded agreement's outcome as every rank reads it: one element of the reduced
        gradient of the sentinel parameter (a failed rank's NaN reached every element)."""
        assert self.sentinel is not None
        grad = self.sentinel.grad
        if grad is None:
            return False  # the backward did not reach it: let the vote say what happened
        return math.isfinite(grad[(0,) * grad.dim()].item())

    def join_backward(self) -> None:
        """This rank failed with the agreement folded into or beside the backward: join the
        peers' gradient all-reduce with NaN, as a synced backward of its own would have, and
        agree."""
        g = self.guard
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the buckets must fit where the forward failed
        status = self.pending if self.pending is not None else _EXC
        if self.sentinel is None:
            self.launch(status)  # beside: the peers' vote is already under way
        g.watchdog.progress.enter(Phase.AGREE)
        assert isinstance(self.model, DistributedDataParallel)
        try:
            match_backward_all_reduce(self.model, fill=math.nan)
        except RuntimeError as e:
            g.fail_fast(e)
        if self.sentinel is not None:
            self.launch(status)  # folded: the peers vote once they read the NaN
        self.finish()

    def agree(self, status: int) -> None:
        """The one agreement of this attempt, before any synced backward; exits the process
        when the group must stop."""
        if not self.in_place:  # failures there take the store path: nothing to agree on
            self.agreed = True
            self.outcome = _OK
            return
        self.launch(status)
        # what follows sets its own phase: backward, a retry's forward, or the exit
        self.guard.watchdog.progress.enter(Phase.AGREE)
        self.finish()

    def launch(self, status: int) -> None:
        """Start this rank's vote (asynchronously; `finish` waits for it)."""
        g = self.guard
        self.agreed = True
        floor = g.config.min_micro_batch_size
        cannot_halve = int(self.n // (2 * self.k) < floor or 2 * self.k > self.n)
        mine = (status << 32) | (_LOW - g.ctx.rank) if status != _OK else 0
        self._vote = torch.tensor([mine, cannot_halve], dtype=torch.int64)
        if g.ctx.distributed:
            try:
                self._work = dist.all_reduce(
                    self._vote, op=dist.ReduceOp.MAX, group=g.ctx.control_group, async_op=True
                )
            except RuntimeError as e:
                g.fail_fast(e)

    def finish(self) -> None:
        """Wait for the vote and carry out what it says; exits when the group must stop."""
        g = self.guard
        rank = g.ctx.rank
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                g.fail_fast(e)
        assert self._vote is not None
        top, cannot_halve = int(self._vote[0]), int(self._vote[1])
        worst = top >> 32
        self.failed_rank = _LOW - (top & _LOW) if worst != _OK else -1
        if worst == _OK:
            self.outcome = _OK
            return
        if worst == _OOM and self.in_place and not cannot_halve:
            self.outcome = _OOM
            return
        step = g.watchdog.progress.step
        if worst == _EXC and g.rollback is not None and g.rollback(step, self.failed_rank):
            self.outcome = _ROLLBACK
            return
        code = ExitCode.OOM if worst == _OOM else ExitCode.RANK_EXCEPTION
        if rank == 0:
            g._log.error(
                "guard.agreed",
                action="exit",
                failed_rank=self.failed_rank,
                cause="oom" if worst == _OOM else "exception",
                step=step,
                split=self.k,
                floor_reached=bool(cannot_halve) if worst == _OOM else None,
                exit_code=int(code),
            )
        if worst == _OOM:
            g._carry(self.k, reason="oom at the micro-batch floor", rank=self.failed_rank)
        exit_now(code, kind="guard", ranks=[self.failed_rank], step=step)


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
