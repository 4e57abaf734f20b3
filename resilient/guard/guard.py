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

This module is the Guard and its store path, which `rt.guard()` takes and so does any
failure that the in-place agreement of micro-batches cannot take. Why it never deadlocks: a
rank that raises must not wait where its peers cannot come. With `rt.guard()`, and with
FSDP or any model that may hold collectives inside its forward, the failing rank publishes a
verdict through the store; every rank's watchdog thread, which never joins a collective,
carries it out (os._exit) within one heartbeat interval, also on ranks blocked in a
collective. No collective is needed to agree. Under hot recovery the failing rank leaves
alone instead and is replaced warm (hot/recovery.py, leave_for_replacement); the same
failure again at the same step takes the verdict.

The micro-batch form with DDP retries in place instead: the iteration and its retry are
microbatch.py, the one agreement of each attempt attempt.py. The Guard also keeps the split
(micro-batches per batch) that an OOM grew, in the store and a file, for later attempts.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import nn

from resilient.exitcodes import ExitCode
from resilient.groups.exits import exit_now
from resilient.groups.groups import DistContext
from resilient.guard.failure import classify, short
from resilient.guard.microbatch import MicroBatch, MicroBatches
from resilient.hang.watchdog import Watchdog
from resilient.log import get_logger

__all__ = ["SPLIT_FILE", "Guard", "PeerLossRecovery"]

_SPLIT_KEY = "resilient/guard/split"
SPLIT_FILE = "micro_batch_split.json"
"""Written to the run directory when the split grows, read by the next attempt."""


class PeerLossRecovery(Protocol):
    """Hot recovery as the guard uses it (hot/recovery.py's HotRecovery)."""

    def restart(self, exc: BaseException) -> NoReturn:
        """A lost peer: re-run the script in place (raises HotRestart) or exit cold."""
        ...

    def leave_for_replacement(self, exc: BaseException, kind: str, split: int) -> None:
        """This rank's own failure (kind, split) outside the in-place agreement: leave this
        process alone, to be replaced hot (exits), or return when the group must go cold."""
        ...


class Guard:
    """Created by the Runtime; reached through `rt.guard()` and `rt.micro_batches()`.

    Its collaborators come at construction: `rollback(step, failed_rank)` when snapshots are
    on (called on every rank once the in-place agreement found an exception; True: roll
    back, not exit), `recovery` under hot recovery (a lost peer re-runs the script in place,
    this rank's own failure is replaced), and `stop_requested()`: has a stop (preemption)
    signal arrived? Then a lost peer means the launcher is already taking the group down,
    and no verdict is worth waiting for."""

    def __init__(
        self,
        watchdog: Watchdog,
        ctx: DistContext,
        run_dir: str,
        *,
        rollback: Callable[[int, int], bool] | None = None,
        recovery: PeerLossRecovery | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        self.watchdog = watchdog
        self.ctx = ctx
        self.config = watchdog.config
        self.split = 1
        """Micro-batches per batch; grows on OOM and stays grown (also across restarts)."""
        self._path = Path(run_dir) / SPLIT_FILE
        self.log = get_logger()
        self.failing = False
        """In fail_fast: a stop signal from the launcher now means "leave", not "save"."""
        self.rollback = rollback
        self.recovery = recovery
        self.stop_requested = stop_requested
        self._micro_batches = MicroBatches(self)

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
            self.log.info("guard.split", split=split, source="carried from an earlier attempt")
        return split

    def carry(self, split: int, **why: Any) -> None:
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
        if self.recovery is not None or classify(exc) == "peer":
            self.fail_fast(exc)

    def fail_fast(self, exc: BaseException) -> NoReturn:
        """Log `exc`, publish a verdict naming this rank and exit with every other rank."""
        wd = self.watchdog
        if wd.verdict_pending():
            wd.wait_for_verdict(1.0)
        kind = classify(exc)
        step, phase = wd.progress.step, wd.progress.phase.name.lower()
        if kind != "peer":  # this rank's own failure
            hot = None if self.stop_requested() else self.recovery
            self.log.error(
                "guard.failure",
                kind=kind,
                step=step,
                phase=phase,
                error=short(exc),
                exc_info=exc,
                **({"action": "hot replacement"} if hot is not None else {}),
            )
            if kind == "oom":  # the next attempt, or generation, starts at twice the split
                self.carry(self.split * 2, reason="oom", rank=self.ctx.rank)
            if hot is not None:
                hot.leave_for_replacement(exc, kind, self.split)  # exits alone, or: cold
        self.failing = True
        if kind == "peer":
            self.log.warning("guard.peer_error", step=step, phase=phase, error=short(exc))
            if self.recovery is not None and not self.stop_requested():
                self.failing = False
                self.recovery.restart(exc)  # raises HotRestart, or exits cold with a reason
            if self.stop_requested():
                exit_now(ExitCode.PEER_LOST, kind="peer_lost", reason="stopped by the launcher")
            cfg = self.config
            wd.wait_for_verdict(cfg.heartbeat_timeout_s + 2 * cfg.heartbeat_interval_s + 1)
            wd.abort(
                kind="peer_lost",
                code=ExitCode.PEER_LOST,
                ranks=[],
                reason=f"rank {self.ctx.rank} at step {step} ({phase}): {short(exc)}",
                expect_acks=self.ctx.world_size - 1,
            )
        oom = kind == "oom"
        wd.report_failure(oom=oom)
        wd.abort(
            kind="failure",
            code=ExitCode.OOM if oom else ExitCode.RANK_EXCEPTION,
            ranks=[self.ctx.rank],
            reason=f"{short(exc)} on rank {self.ctx.rank} at step {step} ({phase})",
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
        return self._micro_batches.iterate(tensors, model, split)
