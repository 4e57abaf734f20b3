"""One attempt of a batch in micro-batches, and its one agreement across ranks.

Why the in-place agreement of `rt.micro_batches` with DDP never deadlocks. A rank that
raises must not wait where its peers cannot come. DDP's forward holds no collective once
the first micro-batch started (its buffer broadcast comes first; micro-batches but the last
run under no_sync; its one bucket rebuild is done at track() and after a reset,
groups/ddp.py), and no_sync backwards hold none. The only gradient all-reduce is the last
micro-batch's backward. Every attempt agrees exactly once on every rank: through a vote, an
all_reduce(MAX) of a status code on the control group, or, folded into the gradient
all-reduce, through its result alone (below). All OK: the step goes on. An OOM: every rank
restores the RNG and gradients and retries the same batch in twice as many micro-batches
(microbatch.py). Anything else, or the floor reached: every rank exits with the same code
(or rolls back, memory/snapshot.py). A failure *after* the agreement started (inside the
synced backward) takes the guard's store path (guard.py), since peers may be blocked in the
all-reduce. Where the agreement happens:
- *Folded into the gradient all-reduce* (the usual case on CPU, from a batch's second
  attempt on: once this body was seen calling `mb.backward` on its last micro-batch, with
  DDP, find_unused_parameters=False, CPU gradients and no Python comm hook). Healthy ranks
  hold no vote of their own: a failing rank, after its `with mb:` block (the failed
  forward's memory is released by then), joins the backward's gradient all-reduce with
  every bucket filled with NaN (the reducer's own join mechanism,
  groups/_torch_compat.py), so every rank's reduced gradients are NaN. After the synced
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
If a user's body holds a collective of its own after the failure point, the agreement
cannot complete; the failing rank is flagged in its heartbeat, stalls in phase `agree`, and
the hang monitor takes the group down with the OOM/exception code at its timeout.

Apart from the micro-batches themselves (microbatch.py) because the vote and its outcome
are one piece of logic, and each of the two stays readable on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from resilient.exitcodes import ExitCode
from resilient.groups._torch_compat import match_backward_all_reduce
from resilient.groups.exits import exit_now
from resilient.groups.groups import DistContext
from resilient.guard.failure import classify, short
from resilient.hang.config import WatchdogConfig
from resilient.hang.phases import Phase
from resilient.hang.watchdog import Watchdog

__all__ = ["EXC", "OK", "OOM", "ROLLBACK", "Attempt", "Guard", "Retry"]

OK, OOM, EXC = 0, 1, 2
ROLLBACK = 3  # an outcome only: every rank rolls back in place (memory/snapshot.py)
_LOW = 0xFFFFFFFF


class Retry(Exception):
    """Raised in the last micro-batch of healthy ranks when the group agreed to retry."""


class Guard(Protocol):
    """What an attempt uses of the Guard that runs it (guard.py): kept to a protocol so that
    this module need not import the guard, which imports it."""

    watchdog: Watchdog
    ctx: DistContext
    config: WatchdogConfig
    split: int
    rollback: Callable[[int, int], bool] | None
    log: Any

    def fail_fast(self, exc: BaseException) -> NoReturn: ...

    def carry(self, split: int, **why: Any) -> None: ...


class Attempt:
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
        kind = classify(exc)
        if kind == "peer" or not self.in_place or self.agreed:
            g.fail_fast(exc)
        wd = g.watchdog
        oom = kind == "oom"
        g.log.error(
            "guard.failure",
            kind=kind,
            step=wd.progress.step,
            phase=wd.progress.phase.name.lower(),
            micro_batch=index,
            micro_batches=self.k,
            error=short(exc),
            exc_info=exc,
        )
        wd.report_failure(oom=oom)
        if self.beside:
            self.pending = OOM if oom else EXC
            return
        self.agree(OOM if oom else EXC)

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
        status = self.pending if self.pending is not None else EXC
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
            self.outcome = OK
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
        mine = (status << 32) | (_LOW - g.ctx.rank) if status != OK else 0
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
        self.failed_rank = _LOW - (top & _LOW) if worst != OK else -1
        if worst == OK:
            self.outcome = OK
            return
        if worst == OOM and self.in_place and not cannot_halve:
            self.outcome = OOM
            return
        step = g.watchdog.progress.step
        if worst == EXC and g.rollback is not None and g.rollback(step, self.failed_rank):
            self.outcome = ROLLBACK
            return
        code = ExitCode.OOM if worst == OOM else ExitCode.RANK_EXCEPTION
        if rank == 0:
            g.log.error(
                "guard.agreed",
                action="exit",
                failed_rank=self.failed_rank,
                cause="oom" if worst == OOM else "exception",
                step=step,
                split=self.k,
                floor_reached=bool(cannot_halve) if worst == OOM else None,
                exit_code=int(code),
            )
        if worst == OOM:
            g.carry(self.k, reason="oom at the micro-batch floor", rank=self.failed_rank)
        exit_now(code, kind="guard", ranks=[self.failed_rank], step=step)
