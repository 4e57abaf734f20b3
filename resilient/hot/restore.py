"""Every rank of a new hot generation restores the newest snapshot step all of them can.

Each rank says what it holds (one all_gather on the control group); `plan_restore` then
decides, the same way on every rank, which step to restore and where each replacement's
state comes from. With DDP any survivor holds the replicated model and optimizer state, and
the replacement's per-rank part (RNG, data position) is with its buddy, or in the launcher's
store with replicas=0. Under HSDP a replacement's shards are in its replicate peers' own
snapshots, and its per-rank part with its buddy, one of those peers. With FSDP2 alone (or
dp x tp) a replacement's shards exist only in its buddy's replica.
`resume` carries the plan out: point-to-point sends, then the restore into the live objects.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from resilient import events as ev
from resilient.envvars import HotMode
from resilient.hot import carry as carried
from resilient.hot.host import RecoveryHost
from resilient.log import get_logger
from resilient.memory.replica import recv_state, rehydrate, send_state

__all__ = ["RestorePlan", "Resumed", "plan_restore", "resume"]


@dataclass(frozen=True)
class Resumed:
    step: int
    """The snapshot step every rank restored."""
    catch_up: bool
    """A durable save was lost with the peer and the replay will not make it again on the
    step schedule: every rank saves `step` before its first batch (otherwise each hot recovery
    during a save leaves the newest checkpoint one interval further behind, and a later cold
    fallback replays all of that)."""


@dataclass(frozen=True)
class RestorePlan:
    """What every rank agreed from what each one holds (`plan_restore`)."""

    target: int | None
    """The snapshot step to restore; None: no step every rank can restore (go cold)."""
    survivors: list[int]
    sharded: bool
    source: dict[int, int] = field(default_factory=dict)
    """Replacement -> the survivor that sends its state (-1: none can)."""
    part_from: dict[int, int] = field(default_factory=dict)
    """Replacement -> the survivor holding its per-rank part (DDP, HSDP)."""
    restorable: dict[int, set[int]] = field(default_factory=dict)
    """Rank -> the snapshot steps it can restore."""
    why_not: str = ""
    """With no target: why, for the event."""
    peered: set[int] = field(default_factory=set)
    """Replacements whose shards come from a replicate peer's own snapshot (HSDP), not from
    a whole replica at their buddy."""

    def whole(self, rank: int) -> bool:
        """Replacement `rank` gets its whole snapshot from the buddy's replica (FSDP2)."""
        return self.sharded and rank not in self.peered


def plan_restore(every: list[dict[str, Any]]) -> RestorePlan:
    """Decide from every rank's statement (rank order) what to restore. A survivor states
    `steps` (its snapshots), `sharded`, `ward` (whose replica it holds, or None) and
    `ward_steps`; a replacement states `steps` (its per-rank parts found in the store) and
    `survivor: False`. Every rank may state `peers`: its replicate peers when they hold its
    shards (HSDP), else None. Pure: every rank computes the same plan from the same list.

    Where a replacement's state comes from: with DDP, the model and optimizer from any
    survivor; under HSDP, its shards from a surviving replicate peer's own snapshot (the same
    shards: no replica of them is kept); with FSDP2 alone (or dp x tp), everything from the
    whole replica its buddy keeps. The per-rank part (RNG, data position) in the first two
    from its buddy (under HSDP a replicate peer too) or, with replicas=0, the store."""
    survivors = [r for r, m in enumerate(every) if m["survivor"]]
    alive = set(survivors)
    sharded = any(every[r]["sharded"] for r in survivors)
    source: dict[int, int] = {}
    part_from: dict[int, int] = {}
    restorable: dict[int, set[int]] = {}
    peered: set[int] = set()
    unpeered: list[int] = []
    for r, m in enumerate(every):
        if m["survivor"]:
            restorable[r] = set(m["steps"])
            continue
        holders = [s for s in survivors if every[s]["ward"] == r]
        peers = m.get("peers")
        if sharded and not peers:
            source[r] = holders[0] if holders else -1
            restorable[r] = set(every[holders[0]]["ward_steps"]) if holders else set()
            continue
        if peers:
            peered.add(r)
            alive_peers = [p for p in peers if p in alive]
            source[r] = alive_peers[0] if alive_peers else -1
        else:
            source[r] = survivors[0] if survivors else -1
        if holders:
            part_from[r] = holders[0]
        restorable[r] = set(every[holders[0]]["ward_steps"]) if holders else set(m["steps"])
        if source[r] < 0:
            restorable[r] = set()
            unpeered.append(r)
    common = set.intersection(*restorable.values()) if restorable else set()
    target = max(common) if common and survivors else None
    why_not = ""
    if target is None:
        orphans = [r for r, src in source.items() if src < 0 and r not in peered]
        if unpeered:
            why_not = f"no replicate peer of rank(s) {unpeered} survived: their shards are gone"
        elif sharded and orphans and all(every[s]["ward"] is None for s in survivors):
            why_not = (
                "sharded state, and no rank keeps a replica of another's "
                "(snapshot replicas=0): a lost rank's shards are gone"
            )
        elif sharded and orphans:
            why_not = f"the replica of rank(s) {orphans} was lost with them (their buddy too)"
        else:
            why_not = "no snapshot step every rank can restore"
    return RestorePlan(target, survivors, sharded, source, part_from, restorable, why_not, peered)


def put_replica(store: Any, mode: HotMode, rank: int, held: dict[int, bytes]) -> None:
    """Keep this rank's per-rank state (RNG, data position: a few KiB) of the snapshot steps
    it holds where a replacement can read it: the launcher's store, one key per rank. Only
    with replicas=0: a set per rank per snapshot is N requests to one server at every
    snapshot, which the buddy exchange (memory/replica.py) spreads over the ranks' pairs."""
    store.set(mode.keys.replica(rank), pickle.dumps(held))


def _get_replica(store: Any, mode: HotMode, rank: int) -> dict[int, bytes]:
    key = mode.keys.replica(rank)
    if not store.check([key]):
        return {}
    return dict(pickle.loads(bytes(store.get(key))))  # written by our own rank's snapshots


def resume(host: RecoveryHost, mode: HotMode) -> Resumed | None:
    """In Runtime.resume() of generation g >= 1 (hot on): restore the newest snapshot step every
    rank can restore. Returns that step, or None to load from storage as a cold start would.
    Collectives on the control group: every rank of the generation calls it. Raises
    ValueError when the snapshot does not fit the model here (the caller goes cold)."""
    log = get_logger()
    t0 = time.monotonic()
    carry = carried.take()
    store, group, rank = host.ctx.base_store, host.ctx.control_group, host.rank
    replica: dict[int, bytes] = {}
    if carry is not None:
        mine = {
            "steps": carry.steps,
            "survivor": True,
            "at": carry.step,
            "lost": carry.lost_save,
            "sharded": carry.sharded,
            "ward": carry.ward,
            "ward_steps": sorted(carry.replica),
            "every": carry.interval.get("every"),
        }
    else:  # the replacement; with replicas=0 its predecessor's per-rank part is in the store
        replica = _get_replica(store, mode, rank) if store is not None else {}
        mine = {"steps": sorted(replica), "survivor": False, "at": None, "lost": None}
    mine["peers"] = host.layout.replicas(rank) if host.snapshots.peered else None
    every: list[Any] = [None] * host.world_size
    dist.all_gather_object(every, mine, group=group)
    plan = plan_restore(every)
    target = plan.target
    if target is None:
        if rank == 0:
            held = {str(r): sorted(steps) for r, steps in plan.restorable.items()}
            log.error(ev.RECOVERY_COLD, reason=plan.why_not, held=held)
        return None
    if carry is not None:
        sd = carry.buffers[target]
        for r, src in plan.source.items():  # point to point, to each replacement
            if src == rank and plan.whole(r):  # the ward's whole state, kept for it
                send_state(carry.replica[target], r, group)
            elif src == rank:  # the model and optimizer state (HSDP: the same shards)
                send_state({k: v for k, v in sd.items() if not k.startswith("rank")}, r, group)
            if plan.part_from.get(r) == rank:  # and its own part, kept for it
                dist.send_object_list([carry.replica[target][f"rank{r}"]], dst=r, group=group)
    else:
        sd = recv_state(plan.source[rank], group)
        if not plan.whole(rank) and rank in plan.part_from:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=plan.part_from[rank], group=group)
            sd[f"rank{rank}"] = box[0]
        elif not plan.whole(rank):
            sd[f"rank{rank}"] = replica[target]
    transfer_s = time.monotonic() - t0
    try:
        host.state.apply(rehydrate(sd, host.state.model), rank=rank)
    except ValueError as e:  # a shard that does not fit this rank's parameters
        raise ValueError(f"the snapshot of step {target} does not fit the model here: {e}") from e
    del sd
    if carry is not None:
        carry.buffers.clear()
        carry.replica.clear()
    # the snapshot interval goes on where it was (the largest a survivor held: every rank
    # must snapshot at the same steps), not from every step again
    held_every = [int(every[r]["every"]) for r in plan.survivors if every[r].get("every")]
    if held_every:
        host.snapshots.adopt_interval(max(held_every), carry.interval if carry else None)
    lost = sorted({m["lost"] for m in every if m["lost"] is not None})
    # a lost save past the target is made again by the replay when the step policy saves there
    catch_up = any(s <= target or not host.saves_on_schedule(s) for s in lost)
    fields: dict[str, Any] = {
        "to_step": target,
        "steps_lost": max(int(every[r]["at"]) for r in plan.survivors) - target,
        "generation": mode.generation,
        "survivor": carry is not None,
        "from_rank": plan.source.get(rank, rank),
        "part_from": None
        if carry is not None or plan.whole(rank)
        else plan.part_from.get(rank, "store"),
        "sharded": plan.sharded,
        "from_replicate_peer": rank in plan.peered,
        "transfer_s": round(transfer_s, 4),
        "restore_s": round(time.monotonic() - t0, 4),
        "lost_saves": lost,
        "catch_up_save": target if catch_up else None,
    }
    if carry is not None:
        fields.update({k: round(v, 4) for k, v in carry.timings.items()})
        fields["since_detect_s"] = round(time.monotonic() - carry.detected_at, 4)
    log.warning(ev.RECOVERY_HOT_FORMED, **fields)
    if rank == 0 and store is not None:
        store.set(mode.keys.formed(mode.generation), "1")
    return Resumed(target, catch_up=catch_up)
