"""Buddy replicas of sharded snapshots: what lets a lost FSDP2 rank be replaced hot.

With DDP every rank holds the whole model and optimizer state, so a replacement gets it from
any survivor (hot/recovery.py). With FSDP2 a rank's shards exist on that rank only; when it
dies, its in-memory snapshots die with it. So after each snapshot every rank sends its copy to
its buddy (memory/placement.py: the same local rank on the next host; on one host, the next
local rank), in the background, over a gloo group of its own, and receives its ward's copy
(the rank it is the buddy of) into two buffers of its own: a replica is complete or absent,
never half-written, and the previous one stays complete while the next arrives.

At a hot recovery the replacement of rank r restores from the replica its buddy holds; a
rank lost together with its buddy has no copy left and the group goes cold (hot/restore.py says
so). Memory: the ward's copy, twice (checked in Snapshots.track with the rank's own two).

A DTensor cannot outlive the process groups of its mesh, and a hot recovery destroys them. So
what crosses a recovery, or the wire, is a *shard*: the local tensor with the placements and
global shape it had; `rehydrate` makes DTensors of them again on the new generation's mesh,
which has the same world size and so the same local shapes (checked).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from resilient import faultpoints
from resilient.checkpoint.state import flat_state_param
from resilient.groups._torch_compat import lazy_gloo_connections
from resilient.groups.groups import DistContext
from resilient.log import get_logger
from resilient.memory.placement import buddies

__all__ = ["BuddyReplicas", "is_sharded", "localize", "recv_state", "rehydrate", "send_state"]

_SHARD = "__resilient_shard__"
"""Marks a dict that stands for a DTensor: {_SHARD: local tensor, placements, shape, stride}."""


# ---------------------------------------------------------------- shards without a mesh
def is_sharded(obj: Any) -> bool:
    """Whether a state dict holds DTensors (or shards of them)."""
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, dict):
        return _SHARD in obj or any(is_sharded(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(is_sharded(v) for v in obj)
    return False


def localize(obj: Any) -> Any:
    """`obj` with each DTensor replaced by its shard (a view of its local tensor, no copy)."""
    if isinstance(obj, DTensor):
        return {
            _SHARD: obj.to_local(),
            "placements": tuple(obj.placements),
            "shape": tuple(obj.shape),
            "stride": tuple(obj.stride()),
        }
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(localize(v) for v in obj)
    return obj


def rehydrate(sd: dict[str, Any], model: nn.Module | None) -> dict[str, Any]:
    """The shards of a localized state dict as DTensors on `model`'s mesh again.

    Model entries and optimizer-state entries are keyed by parameter name; each shard goes
    onto the mesh of the live parameter of that name, and must have the local shape that
    parameter has here (the world size of a hot recovery never changes). ValueError if not."""
    if model is None or not is_sharded(sd):
        return sd
    live = get_model_state_dict(model)

    def wrap(name: str, shard: dict[str, Any]) -> DTensor:
        ref = live.get(name)
        if not isinstance(ref, DTensor):
            raise ValueError(f"snapshot shard {name!r} has no sharded parameter of that name here")
        local = shard[_SHARD]
        if tuple(shard["shape"]) != tuple(ref.shape):
            raise ValueError(
                f"snapshot shard {name!r}: global shape {tuple(shard['shape'])} where the "
                f"parameter here is {tuple(ref.shape)}"
            )
        if local.shape != ref.to_local().shape:
            raise ValueError(
                f"snapshot shard {name!r}: local shape {tuple(local.shape)} where this rank "
                f"holds {tuple(ref.to_local().shape)} (a different sharding)"
            )
        return DTensor.from_local(
            local,
            ref.device_mesh,
            shard["placements"],
            run_check=False,
            shape=torch.Size(shard["shape"]),
            stride=tuple(shard["stride"]),
        )

    def each(name: str, obj: Any) -> Any:
        if isinstance(obj, dict) and _SHARD in obj:
            return wrap(name, obj)
        if isinstance(obj, dict):
            return {k: each(name, v) for k, v in obj.items()}
        return obj

    out = dict(sd)
    if "model" in sd:
        out["model"] = {k: each(k, v) for k, v in sd["model"].items()}
    if "optim" in sd:
        optim = dict(sd["optim"])
        if "state" in optim or not any(k.startswith("state.") for k in optim):
            optim["state"] = {k: each(k, v) for k, v in optim.get("state", {}).items()}
        else:  # flattened per parameter, "state.<fqn>.<name>" (what pipeline stages save)
            optim = {
                k: each(flat_state_param(k, live) or k.removeprefix("state."), v)
                if k.startswith("state.")
                else v
                for k, v in optim.items()
            }
        out["optim"] = optim
    return out


# ---------------------------------------------------------------- state on the wire
class _Slot:
    """Where a tensor goes in the structure sent ahead of the tensors themselves."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with each tensor replaced by a _Slot and appended to `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous())
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, make: Callable[[_Slot], torch.Tensor]) -> Any:
    """The structure with each _Slot replaced by `make(slot)`."""
    if isinstance(obj, _Slot):
        return make(obj)
    if isinstance(obj, dict):
        return {k: _fill(v, make) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_fill(v, make) for v in obj)
    return obj


def send_state(sd: dict[str, Any], dst: int, group: Any) -> None:
    """Send a state dict of CPU tensors to `dst`: its structure (tensors replaced by slots)
    as one object, then each tensor as it is, with no pickling of the bytes (pickling 100 MB
    of state took 0.6 s; raw sends run at the link's speed)."""
    tensors: list[torch.Tensor] = []
    structure = _strip(sd, tensors)
    dist.send_object_list([structure], dst=dst, group=group)
    for t in tensors:
        if t.numel():  # the receiver knows an empty tensor's shape already
            dist.send(t, dst=dst, group=group)


def recv_state(src: int, group: Any) -> dict[str, Any]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    made: list[tuple[int, torch.Tensor]] = []

    def make(slot: _Slot) -> torch.Tensor:
        t = torch.empty(slot.shape, dtype=slot.dtype)
        made.append((slot.index, t))
        return t

    sd = _fill(box[0], make)
    for _, t in sorted(made, key=lambda it: it[0]):
        if t.numel():
            dist.recv(t, src=src, group=group)
    return dict(sd)


# ---------------------------------------------------------------- the replication
class BuddyReplicas:
    """This rank's side of the replication: sends its snapshots to its buddy, keeps its
    ward's. `send()` is called on every rank at the same snapshot steps (the snapshots are
    taken at agreed steps), so the exchanges pair up without a schedule of their own."""

    def __init__(self, ctx: DistContext, *, timeout_s: float = 300.0) -> None:
        self.ctx = ctx
        self._timeout = timedelta(seconds=timeout_s)
        self._log = get_logger()
        self._group: Any = None
        self.buddy = -1
        """The rank that holds this rank's replica."""
        self.ward = -1
        """The rank whose replica this rank holds."""
        self.ring: list[int] | None = None
        """This rank's replicate peers (itself included, set before the first exchange) when
        they hold its shards (HSDP): the buddy is the next of them, the ward the one before,
        and only the per-rank part crosses. None: placed by host (memory/placement.py)."""
        self._buf: list[dict[str, Any] | None] = [None, None]
        self._steps = [-1, -1]
        self._thread: threading.Thread | None = None
        self.broken: str | None = None
        """Why replication stopped (a peer lost mid-exchange); no replica is updated after."""
        self.seconds = 0.0
        """Wall time of the last exchange."""

    def _connect(self) -> None:
        """The replication's own gloo group and the buddy map: collectives on every rank, in
        the loop's thread, at the first sharded snapshot (a DDP run never pays for them)."""
        ring = self.ring
        if ring is not None and len(ring) > 1:  # every rank of a mesh takes this branch
            i = ring.index(self.ctx.rank)
            self.buddy, self.ward = ring[(i + 1) % len(ring)], ring[i - 1]
        else:
            hosts: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(hosts, self.ctx.host, group=self.ctx.control_group)
            b = buddies([str(h) for h in hosts])
            self.buddy = int(b[self.ctx.rank])
            self.ward = int(next(r for r in range(len(b)) if int(b[r]) == self.ctx.rank))
        with lazy_gloo_connections():  # only buddy pairs ever connect: O(N), not N(N-1)
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        self._log.info("snapshot.replica", buddy=self.buddy, ward=self.ward)

    def send(self, step: int, snapshot: dict[str, Any]) -> None:
        """Start sending this rank's snapshot of `step` to the buddy, and receiving the
        ward's of the same step, in the background. The caller must not change `snapshot`
        until `wait()` returned."""
        if self.broken is not None or self.ctx.world_size < 2:
            return
        self.wait()
        if self._group is None:
            self._connect()
        payload = localize(snapshot)
        self._thread = threading.Thread(
            target=self._exchange, args=(step, payload), name="resilient-replica", daemon=True
        )
        self._thread.start()

    @property
    def group(self) -> Any:
        """The replication's gloo group; None before the first exchange made it."""
        return self._group

    @property
    def busy(self) -> bool:
        """An exchange is in flight."""
        t = self._thread
        return t is not None and t.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the exchange in flight ended (or `timeout`); False if it is still running."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
            self._thread = None
        return True

    def _exchange(self, step: int, payload: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        slot = 0 if self._steps[0] <= self._steps[1] else 1  # the older replica
        self._steps[slot] = -1  # incomplete until every tensor arrived
        try:
            self._buf[slot] = self._swap(step, payload, self._buf[slot])
            self._steps[slot] = step
        except (RuntimeError, dist.DistError) as e:  # a peer lost: the main thread sees it too
            self.broken = f"{type(e).__name__}: {str(e)[:200]}"
            self._buf[slot] = None
            self._log.warning("snapshot.replica_failed", step=step, error=self.broken)
        self.seconds = time.perf_counter() - t0

    def _swap(self, step: int, payload: dict[str, Any], into: dict[str, Any] | None) -> Any:
        """Send `payload` to the buddy, receive the ward's into tensors reused from `into`."""
        g, buddy, ward = self._group, self.buddy, self.ward
        mine: list[torch.Tensor] = []
        header = pickle.dumps((step, _strip(payload, mine)))
        n_in = torch.zeros(1, dtype=torch.int64)
        _wait_all(
            dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst=buddy, group=g),
            dist.irecv(n_in, src=ward, group=g),
        )
        h_in = torch.empty(int(n_in.item()), dtype=torch.uint8)
        _wait_all(
            dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst=buddy, group=g),
            dist.irecv(h_in, src=ward, group=g),
        )
        their_step, structure = pickle.loads(h_in.numpy().tobytes())  # our own peer's
        if their_step != step:
            raise RuntimeError(f"replica exchange out of step: sent {step}, got {their_step}")
        reuse: list[torch.Tensor] = []
        if into is not None:
            _strip(into, reuse)
        made: list[torch.Tensor] = []
        faultpoints.hit(faultpoints.REPLICA_HEADERS, step=step)

        def make(s: _Slot) -> torch.Tensor:
            old = reuse[s.index] if s.index < len(reuse) else None
            t = (
                old
                if old is not None and tuple(old.shape) == s.shape and old.dtype == s.dtype
                else torch.empty(s.shape, dtype=s.dtype)
            )
            made.append(t)
            return t

        theirs = _fill(structure, make)
        _wait_all(
            *[dist.isend(t, dst=buddy, group=g) for t in mine if t.numel()],
            *[dist.irecv(t, src=ward, group=g) for t in made if t.numel()],
        )
        return theirs

    def held(self) -> dict[int, dict[str, Any]]:
        """Step -> the ward's complete snapshot of it (localized)."""
        return {s: b for s, b in zip(self._steps, self._buf, strict=True) if s >= 0 and b}


def _wait_all(*reqs: Any) -> None:
    """Wait for each of these isend/irecv requests."""
    for r in reqs:
        if r is not None:
            r.wait()
