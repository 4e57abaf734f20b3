"""In-memory snapshots of the training state, and the in-place rollback they allow.

Every `every_steps` steps (default: adaptive, see below) each rank copies what a checkpoint of
it would hold into host memory: its model and optimizer shards (DTensor shards stay local:
no collective), the common state (step, scheduler, extras) and its per-rank state (RNG, data
position). Two buffers: the newest complete snapshot stays intact while the next is copied
into the other one, so a failure during a copy still has a complete snapshot to go back to.
Snapshots are local to the rank: they cover failures inside a live process (a Python
exception). A lost process is covered under hot recovery (hot/recovery.py): DDP state is on
every rank anyway, and only its per-rank part goes to a buddy rank; sharded (FSDP2)
snapshots go to the buddy whole (memory/replica.py).

Rollback. When the guard's in-place agreement (guard/attempt.py, DDP micro-batches) finds
that a rank raised, every rank agrees on the newest snapshot step all ranks hold (one
all_reduce on the control group, on the failure path only). The rest of the step's body runs
with zeroed gradients; after it, `Runtime.steps()` puts the snapshot back into the live
objects and continues from that step: the same batches, the same RNG, the same result as a
run that never failed. A second failure of the same rank at the same step is not retried: the
group exits as before (ExitCode.RANK_EXCEPTION) and the supervisor's crash-loop rules apply.

Adaptive interval (memory/interval.py): the copy's cost kept under 2% of a step, by
snapshotting every power-of-two number of steps.

The ranks agree on the interval (MAX, one all_reduce of an int on the control group 4 steps
after the start and every 32 steps), so they all snapshot at the same steps and any two
snapshots a rank holds are held by every rank. Until the first agreement, every step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from resilient import faultpoints
from resilient.checkpoint import TrainState
from resilient.envvars import ENV_SNAPSHOT
from resilient.errors import ConfigError
from resilient.groups.groups import DistContext
from resilient.log import get_logger
from resilient.memory.config import SnapshotConfig
from resilient.memory.interval import Measurements, wanted_interval
from resilient.memory.replica import BuddyReplicas
from resilient.mesh import MeshLayout

__all__ = ["ENV_SNAPSHOT", "SnapshotConfig", "Snapshots", "StepCounter"]

_AGREE_EVERY = 32
"""Steps between agreements on the adaptive interval (one all_reduce of an int)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: its shard on this rank
    return to_local() if to_local is not None else t


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        t = _local(obj)
        return t.numel() * t.element_size()
    if isinstance(obj, bytes | bytearray):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0


def _optimizer_ready(state: TrainState) -> bool:
    """Whether the optimizer has state to copy. Before its first step, asking DCP for its
    state dict would run a step with zero gradients to create it (and count it: Adam's step
    1 would then be step 2), changing the run; no snapshot is taken until then."""
    return state.optimizer is None or bool(state.optimizer.state)


def _estimate(state: TrainState, rank: int) -> int:
    """Bytes of one copy; before the optimizer's first step its state is estimated as two
    tensors per trainable parameter (Adam's moments), measured at the first copy."""
    if _optimizer_ready(state):
        return _nbytes(state.to_state_dict(step=0, rank=rank))
    model = get_model_state_dict(state.model) if state.model is not None else {}
    params = state.model.parameters() if state.model is not None else iter(())
    moments = 2 * sum(_nbytes(p) for p in params if p.requires_grad)
    return _nbytes(model) + moments


def _copy(dst: Any, src: Any) -> Any:
    """`src` copied into `dst` where the structure matches (tensors in place), else anew."""
    if isinstance(src, torch.Tensor):
        if (
            isinstance(dst, torch.Tensor)
            and type(dst) is type(src)
            and dst.shape == src.shape
            and dst.dtype == src.dtype
        ):
            return dst.copy_(src.detach())  # a DTensor copies its local shard, no collective
        return src.detach().to("cpu", copy=True)
    if isinstance(src, dict):
        into = dst if isinstance(dst, dict) else {}
        return {k: _copy(into.get(k), v) for k, v in src.items()}
    if isinstance(src, list | tuple):
        items = dst if isinstance(dst, list | tuple) and len(dst) == len(src) else [None] * len(src)
        return type(src)(_copy(d, v) for d, v in zip(items, src, strict=True))
    return src  # bytes (packed blobs), numbers, strings: immutable


def _clone(obj: Any) -> Any:
    return _copy(None, obj)


class StepCounter:
    """The step numbers `Runtime.steps()` yields, which a rollback can rewind."""

    def __init__(self, start: int, end: int) -> None:
        self.next = start
        self.end = end

    def __iter__(self) -> Iterator[int]:
        while self.next < self.end:
            step = self.next
            self.next += 1
            yield step

    def rewind(self, step: int) -> None:
        self.next = step


class Snapshots:
    """Two host-memory buffers of this rank's state and the rollback decision."""

    def __init__(
        self,
        config: SnapshotConfig,
        ctx: DistContext,
        *,
        replicas: BuddyReplicas | None = None,
        replicate: Callable[[dict[int, bytes]], None] | None = None,
    ) -> None:
        """Under hot recovery, snapshots leave the rank: `replicas` (replicas=1) sends each
        one to this rank's buddy in the background (memory/replica.py), with DDP only its
        per-rank part (RNG, data position: every survivor holds the rest); `replicate`
        (replicas=0) is called with {step: per-rank blob} of the steps held after each
        snapshot (hot recovery keeps them in the launcher's store for a replacement)."""
        self.config = config
        self.ctx = ctx
        self._log = get_logger()
        self._state: TrainState | None = None
        self._buf: list[dict[str, Any] | None] = [None, None]
        self._steps = [-1, -1]
        """The step each buffer holds (-1: none)."""
        self._newest = -1
        self.every = config.every_steps or 1
        self.bytes = 0
        self.copy_s = 0.0
        """Seconds of the last copy (what the adaptive interval weighs)."""
        self._last_t: float | None = None
        self._start: int | None = None
        self.measured = Measurements()
        """What the adaptive interval is decided from (memory/interval.py)."""
        self._exchanging = False
        """An exchange was in flight when the current step began."""
        self._adopted = False
        """The interval and its measurements came from before a hot re-run (adopt_interval):
        no early agreement at the start, they are already known."""
        self._failures: dict[tuple[int, int], int] = {}
        self.pending: int | None = None
        """The snapshot step to roll back to after the current step's body (agreed)."""
        self._held: list[tuple[int, bool]] | None = None  # see keep_at_opening
        self.replicate = replicate
        self.replicas = replicas
        self.sharded = False
        """This rank's model state is not on every rank: the model holds DTensors (FSDP2,
        tp) or the mesh splits it (a pipeline stage). It exists on this rank only, or on its
        replicate peers."""
        self.copies = 2
        """Buffers of this rank's snapshot size held here: its own two, and under hot
        recovery of sharded state the ward's two."""
        self.peered = False
        """Sharded, and a replicate peer holds the same shards (HSDP): the buddy is that
        peer and gets the per-rank part only."""
        self.whole = False
        """The whole snapshot goes to the buddy (sharded, no replicate peer: FSDP2, dp x tp)."""

    @property
    def _replica_kind(self) -> str:
        if self.replicas is None:
            return "store" if self.replicate is not None else "none"
        return "whole" if self.whole else "per-rank part"

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def track(self, state: TrainState, layout: MeshLayout | None = None) -> None:
        """Size the snapshot and check that its buffers fit (ConfigError with the numbers).

        `layout`: the mesh. A sharded rank with a replicate peer (HSDP) sends its buddy, which
        is then that peer, only its per-rank part: the peer's own snapshot holds the same
        shards, so a replacement takes them from there and no second copy is kept."""
        self._state = state
        if not self.enabled:
            return
        size = _estimate(state, self.ctx.rank)
        # a pipeline stage's plain tensors exist on its stage's ranks only, as shards do
        self.sharded = state.model is not None and (
            any(isinstance(p, DTensor) for p in state.model.parameters())
            or (layout is not None and layout.model_parallel)
        )
        peers = layout.replicas(self.ctx.rank) if layout is not None else [self.ctx.rank]
        self.peered = self.sharded and len(peers) > 1
        self.whole = self.sharded and self.replicas is not None and not self.peered
        if self.replicas is not None and self.peered:
            self.replicas.ring = peers
        copies = self.copies = 4 if self.whole else 2
        need = copies * size
        what = "two copies" if copies == 2 else "four copies, two of them its ward's replica"
        avail = int(psutil.virtual_memory().available)
        allowed = int(self.config.memory_fraction * avail)
        if need > allowed:
            raise ConfigError(
                f"in-memory snapshots need {need / 2**20:.1f} MiB of host memory on rank "
                f"{self.ctx.rank} ({what} of {size / 2**20:.1f} MiB), more than "
                f"memory_fraction={self.config.memory_fraction} of the "
                f"{avail / 2**20:.1f} MiB available: turn snapshots off "
                "(snapshot={'enabled': False}), shard the state over more ranks, or raise "
                "memory_fraction if the memory is really free"
            )
        self.bytes = size
        self._log.info(
            "snapshot.memory",
            bytes_per_copy=size,
            copies=copies,
            total_bytes=need,
            available_bytes=avail,
            every_steps=self.config.every_steps or "adaptive",
            replica=self._replica_kind,
            replica_bytes=2 * size if self.whole else 0,
        )

    # ------------------------------------------------------------------ taking them
    def after_step(self, step: int, *, force: bool = False) -> None:
        """Called on every rank after `step` steps are complete (and any save of them
        started). With the adaptive interval, a collective on the control group 4 steps
        after the start and every 32 steps: every rank then snapshots at the same steps."""
        if not self.enabled or self._state is None:
            return
        if self._held is not None:
            self._held[:] = [(step, force)]
            return
        self._after_step(step, force)

    def keep_at_opening(self) -> None:
        """From now on a closed step's snapshot waits for `opening()` of the next step, where a
        framework's loop (runtime/driven.py) saves: its epoch's end in between (validation
        draws from the RNG) would be left out of a snapshot taken before, once restored."""
        self._held = []

    def opening(self) -> None:
        """The next step opens: the held snapshot, if one waits."""
        if self._held:
            step, force = self._held.pop()
            self._after_step(step, force)

    def _after_step(self, step: int, force: bool) -> None:
        now = time.perf_counter()
        if self._last_t is not None:
            self.measured.step(now - self._last_t, exchanging=self._exchanging)
        if self._start is None:
            self._start = step
        if self.config.every_steps is None and (
            (step - self._start == 4 and not self._adopted)
            or (step > self._start and step % _AGREE_EVERY == 0)
        ):
            self._agree_interval()
        if force or step % self.every == 0:
            self.take(step)
        replicas = self.replicas if self.whole else None
        self._exchanging = replicas is not None and replicas.busy
        self._last_t = time.perf_counter()

    def interval_state(self) -> dict[str, Any]:
        """The adaptive interval and what it was agreed from, for a hot re-run to go on with
        (HotRecovery.restart keeps it; adopt_interval takes it back)."""
        return {"every": self.every, "lists": self.measured.as_dict()}

    def adopt_interval(self, every: int, state: dict[str, Any] | None) -> None:
        """After a hot re-run (every rank of the generation, with the same `every`: the
        largest a survivor held): go on at that interval, with this rank's own measurements
        from before when it has them, instead of snapshotting every step and agreeing again
        four steps in. Does nothing with a fixed interval."""
        if self.config.every_steps is not None:
            return
        self.every, self._adopted = every, True
        self.measured = Measurements.from_dict((state or {}).get("lists"))

    def _agree_interval(self) -> None:
        """The interval this rank wants (memory/interval.py); MAX over ranks."""
        m = self.measured
        want, exchange_s = wanted_interval(
            m,
            budget=self.config.budget,
            current=self.every,
            replicating=self.sharded and self.replicas is not None,
        )
        box = torch.tensor([want], dtype=torch.int64)
        if self.ctx.distributed:
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.ctx.control_group)
        every = int(box.item())
        if every != self.every:
            self._log.info(
                "snapshot.interval",
                every_steps=every,
                wanted_here=want,
                copy_s=round(statistics.median(m.copy_s), 6) if m.copy_s else None,
                step_s=round(statistics.median(m.step_s), 6) if m.step_s else None,
                exchange_s=round(exchange_s, 6) if exchange_s is not None else None,
            )
            self.every = every

    def take(self, step: int) -> None:
        """Copy the state into the older buffer; the newer one stays complete meanwhile."""
        assert self._state is not None
        if step in self._steps or not _optimizer_ready(self._state):
            return
        t0 = time.perf_counter()
        if self.replicas is not None:  # the older buffer may still be on its way to the buddy
            self.replicas.wait()
            if self.measured.spans and self.replicas.seconds > 0:  # how long the last one ran
                self.measured.exchange_took(self.replicas.seconds)
        slot = 0 if self._newest != 0 else 1
        self._steps[slot] = -1  # incomplete until the copy is done
        live = self._state.to_state_dict(step=step, rank=self.ctx.rank)
        self._buf[slot] = _copy(self._buf[slot], live)
        faultpoints.hit(faultpoints.SNAPSHOT_COPIED, step=step)
        self._steps[slot] = step
        self._newest = slot
        key = f"rank{self.ctx.rank}"  # this rank's per-rank part of a snapshot
        if self.replicas is not None and self.whole:
            self.replicas.send(step, self._buf[slot] or {})  # in the background
            self.measured.exchange_started()
        elif self.replicas is not None:  # DDP, HSDP: a (replicate) peer has the rest of it
            # A few KiB, in the background too: waiting for it here would wait for the buddy
            # to reach its own snapshot (+10% of a step at one snapshot a step, measured). A
            # rank lost before the exchange ended (the buddy's drift behind it: milliseconds)
            # costs one step more.
            self.replicas.send(step, {key: (self._buf[slot] or {}).get(key)})
        if self.replicate is not None:
            self.replicate(
                {s: b[key] for s, b in zip(self._steps, self._buf, strict=True) if s >= 0 and b}
            )
        self.copy_s = time.perf_counter() - t0
        self.measured.copy(self.copy_s)
        if self._newest >= 0 and self.bytes and (size := _nbytes(self._buf[slot])) > self.bytes:
            part = _nbytes((self._buf[slot] or {}).get(key))  # the ward's is as large
            self._log.info(
                "snapshot.memory",
                bytes_per_copy=size,
                copies=self.copies,
                measured=True,
                replica=self._replica_kind,
                replica_bytes=2 * (size if self.whole else part),
            )
            self.bytes = size

    @property
    def held(self) -> list[int]:
        return sorted(s for s in self._steps if s >= 0)

    def held_buffers(self) -> dict[int, dict[str, Any]]:
        """Step -> the complete snapshot of it (a hot recovery carries them over)."""
        if not self.enabled:
            return {}
        return {s: b for s, b in zip(self._steps, self._buf, strict=True) if s >= 0 and b}

    # ------------------------------------------------------------------ rolling back
    def agree_rollback(self, step: int, failed_rank: int) -> bool:
        """On every rank, after the guard agreed that `failed_rank` raised at `step`: may the
        group roll back in place? A collective on the control group when snapshots are on."""
        if not self.enabled:
            return False
        key = (step, failed_rank)
        self._failures[key] = self._failures.get(key, 0) + 1
        retry_ok = self._failures[key] <= self.config.max_retries_per_step
        held = self.held
        # the same (step, rank) on every rank, so `retry_ok` agrees; the steps held may not
        # (adaptive intervals): the newest one every rank holds
        common = set(held)
        if self.ctx.distributed:
            every: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(every, held, group=self.ctx.control_group)
            for h in every:
                common &= set(h)
        target = max(common) if common else None
        ok = retry_ok and target is not None
        if self.ctx.rank == 0 or failed_rank == self.ctx.rank:
            self._log.warning(
                "rollback.agreed" if ok else "rollback.refused",
                step=step,
                failed_rank=failed_rank,
                to_step=target,
                held=held,
                reason=None
                if ok
                else (
                    "the same rank failed at the same step after a rollback"
                    if not retry_ok
                    else "no snapshot step held by every rank"
                ),
            )
        if ok:
            self.pending = target
        return ok

    def roll_back(self) -> int:
        """Put the agreed snapshot back into the live objects; returns its step."""
        assert self._state is not None and self.pending is not None
        target, self.pending = self.pending, None
        slot = self._steps.index(target)
        buf = self._buf[slot]
        assert buf is not None
        t0 = time.perf_counter()
        # a copy: optimizer.load_state_dict keeps the tensors it is given, and the buffer
        # must not change when the live state does
        step = self._state.apply(_clone(buf), rank=self.ctx.rank)
        self._log.warning("rollback.done", to_step=step, seconds=round(time.perf_counter() - t0, 4))
        self._last_t = None
        return step
