"""Hot recovery of a lost process: the survivors re-run the script in place.

Under `resilient run --hot-recovery` every worker runs the script through the worker wrapper
(resilient/worker.py), and every rank keeps in-memory snapshots (runtime/snapshot.py). When a
worker dies (kill -9, a crash, an OOM exit):

1. The agent notices the exit, starts a replacement for that one local rank with
   RESILIENT_GENERATION=g+1, and publishes generation g+1 on the store
   (supervisor/agent.py). It does not stop the other workers.
2. A survivor notices the loss as a failed collective (the guard's "peer" classification:
   gloo reports a closed connection at once). Instead of exiting it calls `restart()`: it
   keeps its snapshots in this module, takes its Runtime down without waiting on the lost
   peer (threads stopped, an in-flight save drained, process groups destroyed) and raises
   HotRestart, a BaseException that unwinds the user's script up to the wrapper.
3. The wrapper waits for generation g+1 and runs the script again, in the same process:
   python and torch stay imported, the script builds its model and optimizer again and
   joins the new generation's process groups under their own store prefix.
4. Every rank then resumes in `Runtime.resume()` through `resume()` below, with one
   collective agreement on the newest snapshot step every rank can restore: a survivor from
   its own snapshot, the replacement from a survivor (the replicated DDP state, sent point to
   point) and from the replica of its per-rank state (RNG, data position) that the lost rank
   sent its buddy at each snapshot (runtime/replica.py; with replicas=0 it left it in the
   launcher's store instead). FSDP2 shards come from the buddy's replica of the whole
   snapshot. Durable checkpoints are not read; a durable save the
   loss interrupted is made again at the resumed step when the replay would not make it
   (Resumed.catch_up).

Why the script is re-run rather than the survivors patching their live objects: a replacement
runs the whole start-up of the script (process groups, DDP's construction broadcast, the
bucket pinning, the agreements of init()), and a survivor mid-step would have to mirror each
of those collectives, in order, from wherever it was. Re-running the script makes every rank
run the same code, so the collectives match by construction.

Anything that cannot go hot goes cold (the agent's ordinary restart) with a reason: no
snapshot step every rank can restore, no generation published within `WAIT_S` seconds, a save
that does not drain, a second loss during recovery (the agent's rule).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from resilient import events as ev
from resilient.envvars import (
    ENV_ATTEMPT,
    ENV_GENERATION,
    ENV_HOT,
    WATCHDOG_PREFIX,
    hot_store_prefix,
    int_env,
    worker_store_prefix,
)
from resilient.exitcodes import ExitCode
from resilient.log import get_logger
from resilient.runtime import procinfo
from resilient.runtime.replica import localize, recv_state, rehydrate, send_state

if TYPE_CHECKING:
    from resilient.runtime.runtime import Runtime
    from resilient.runtime.watchdog_config import WatchdogConfig

__all__ = [
    "WAIT_S",
    "HotRestart",
    "Resumed",
    "carried_store",
    "enabled",
    "generation",
    "leave_for_replacement",
    "mark_stepped",
    "put_replica",
    "restart",
    "resume",
    "roll_call",
    "store_prefix",
]

WAIT_S = 30.0
"""How long a survivor waits for the agent's next generation before it gives up (cold)."""
_DRAIN_S = 10.0
"""How long a survivor waits for an in-flight async save to fail or finish."""
_STORE_GONE_S = 3.0
"""How long the store may fail every call before a waiting survivor takes it for gone."""


def enabled() -> bool:
    return os.environ.get(ENV_HOT, "") == "1"


def generation() -> int:
    return int_env(ENV_GENERATION, 0)


def store_prefix(attempt: str | None = None) -> str:
    """The attempt's hot-recovery keys in the launcher's store (no per-attempt prefix)."""
    return hot_store_prefix(attempt if attempt is not None else os.environ.get(ENV_ATTEMPT, "0"))


class HotRestart(BaseException):
    """Unwinds the user's script to the worker wrapper, which runs it again in place.

    A BaseException, so `except Exception` in a training loop does not swallow it."""

    def __init__(self, generation: int, reason: str) -> None:
        super().__init__(f"hot recovery to generation {generation}: {reason}")
        self.generation = generation
        self.reason = reason


@dataclass
class _Carry:
    """What a survivor keeps across the in-place re-run of its script."""

    generation: int
    """The generation it waits for."""
    steps: list[int]
    buffers: dict[int, dict[str, Any]]
    """Snapshot step -> this rank's state dict at that step (host memory)."""
    store: Any
    detected_at: float
    reason: str
    step: int
    """The step whose body was running when the loss was seen."""
    lost_save: int | None
    """The step of this rank's durable save that the loss interrupted (did not commit)."""
    sharded: bool
    """The state is sharded (FSDP2): a replacement needs its buddy's replica."""
    ward: int | None
    """The rank whose replica this rank holds (None: replicas=0)."""
    replica: dict[int, dict[str, Any]]
    """Snapshot step -> the ward's state dict at that step (localized; with DDP its
    per-rank part only)."""
    timings: dict[str, float] = field(default_factory=dict)
    interval: dict[str, Any] = field(default_factory=dict)
    """The adaptive snapshot interval and its measurements (Snapshots.interval_state)."""


_carry: _Carry | None = None


def carried() -> bool:
    return _carry is not None


def carried_store() -> Any:
    """A survivor's connection to the launcher's store, for its re-run (None elsewhere): the
    re-run goes on with the connection it has, and never opens a server of its own."""
    return None if _carry is None else _carry.store


# ---------------------------------------------------------------- the per-rank replica
def put_replica(store: Any, rank: int, held: dict[int, bytes]) -> None:
    """Keep this rank's per-rank state (RNG, data position: a few KiB) of the snapshot steps
    it holds where a replacement can read it: the launcher's store, one key per rank. Only
    with replicas=0: a set per rank per snapshot is N requests to one server at every
    snapshot, which the buddy exchange (runtime/replica.py) spreads over the ranks' pairs."""
    store.set(f"{store_prefix()}/replica/rank_{rank}", pickle.dumps(held))


def _get_replica(store: Any, rank: int) -> dict[int, bytes]:
    key = f"{store_prefix()}/replica/rank_{rank}"
    if not store.check([key]):
        return {}
    return dict(pickle.loads(bytes(store.get(key))))  # written by our own rank's snapshots


# ---------------------------------------------------------------- a survivor
def restart(rt: Runtime, exc: BaseException) -> NoReturn:
    """On a survivor that saw a peer's loss: keep the snapshots, take the Runtime down without
    waiting on the lost peer, and unwind to the wrapper (HotRestart). Exits PEER_LOST (cold)
    when that cannot be done."""
    global _carry
    log = get_logger()
    t0 = time.monotonic()
    gen = generation() + 1
    snaps = rt.snapshots
    # DTensors would not survive their mesh's process groups: keep their shards
    held = {s: localize(b) for s, b in snaps.held_buffers().items()}
    log.warning(
        ev.RECOVERY_HOT_DETECT,
        step=rt.watchdog.progress.step,
        error=f"{type(exc).__name__}: {str(exc)[:300]}",
        held=sorted(held),
        next_generation=gen,
    )
    store = rt.ctx.base_store
    if not held or store is None:
        _cold(rt, "no in-memory snapshot on this rank yet" if not held else "no store")
    if not rt.abandon(drain_s=_DRAIN_S):
        _cold(rt, f"an in-flight async save or replica did not finish within {_DRAIN_S:g} s")
    replicas = snaps.replicas
    _carry = _Carry(
        generation=gen,
        steps=sorted(held),
        buffers=held,
        store=store,
        detected_at=t0,
        reason=str(exc)[:300],
        step=rt.watchdog.progress.step,
        lost_save=rt.lost_save,
        sharded=snaps.sharded,
        ward=replicas.ward if replicas is not None and replicas.ward >= 0 else None,
        replica=replicas.held() if replicas is not None else {},
        timings={"teardown_s": time.monotonic() - t0},
        interval=snaps.interval_state(),
    )
    raise HotRestart(gen, str(exc)[:200])


def leave_for_replacement(rt: Runtime, exc: BaseException, *, kind: str, split: int) -> None:
    """On the rank whose own step raised `exc` outside the guard's in-place agreement (FSDP2,
    `rt.guard()`, an exception that escaped the loop): leave this process alone, with the
    failure's exit code and no verdict for the others, so that the agent replaces it with a
    warm spare and the survivors re-form around it, as after a kill -9. Returns when the
    group must go cold instead, after saying why: the caller then takes its usual path.

    Why the process goes and is not kept: its peers may be blocked in a collective it will
    never enter (FSDP2's all-gathers, DDP's gradient all-reduce). gloo cannot abort one, and
    the connection closes only when the last reference to its process group dies; torch's
    DTensor caches keep the mesh, and with it the group, alive in this process. A closed
    process is the one signal every peer gets at once (docs/hot-recovery.md).

    The same failure (rank, step, kind, micro-batch split) a second time in this attempt goes
    cold (SnapshotConfig.max_retries_per_step): a replay that fails the same way again would
    otherwise be replaced until --hot-max ran out."""
    log = get_logger()
    store, gen, step = rt.ctx.base_store, generation(), rt.watchdog.progress.step
    assert store is not None  # the Runtime sets this path only with the launcher's store
    prefix = store_prefix()
    reason = None
    try:
        times = int(store.add(f"{prefix}/raised/{rt.rank}/{step}/{kind}/{split}", 1))
        if times > rt.snapshots.config.max_retries_per_step:
            reason = f"the same failure at the same step again ({times} times)"
        elif gen and not store.check([f"{prefix}/gen_{gen}/formed"]):
            reason = f"a failure while generation {gen} was still forming"
    except (RuntimeError, dist.DistError, ValueError) as e:
        reason = f"the store failed: {e}"
    if reason is not None:
        log.error(ev.ROLLBACK_REFUSED, step=step, failed_rank=rt.rank, reason=reason, hot=True)
        return
    from resilient.runtime.watchdog import exit_now

    replicas = rt.snapshots.replicas
    if replicas is not None:  # the buddy's copy of this rank's newest snapshot: let it land
        replicas.wait(_DRAIN_S)
    code = ExitCode.OOM if kind == "oom" else ExitCode.RANK_EXCEPTION
    exit_now(code, kind="hot_replacement", reason=f"{type(exc).__name__} at step {step}")


def divert_escaped(exc: Exception) -> bool:
    """For the worker wrapper: an exception escaped the script while this process's Runtime
    is still up. When it is a peer's loss, the guard takes it (a HotRestart, or a cold exit
    with the reason) and this returns True; anything else is the script's own: False."""
    from resilient.runtime.runtime import current

    try:
        rt = current()
    except RuntimeError:  # no Runtime, or already closed or abandoned
        return False
    try:
        rt.guards.on_uncaught(exc)
    except HotRestart:
        return True
    return False


def _cold(rt: Runtime, reason: str) -> NoReturn:
    from resilient.runtime.watchdog import exit_now

    get_logger().error(ev.RECOVERY_COLD, reason=reason, rank=rt.rank)
    exit_now(ExitCode.PEER_LOST, kind="peer_lost", reason=f"hot recovery refused: {reason}")


def note(name: str, seconds: float) -> None:
    """Add a timing of the survivor's way to the new generation (recovery.hot.formed)."""
    if _carry is not None:
        _carry.timings[name] = seconds


def await_generation() -> int:
    """In the wrapper, after HotRestart: wait until the agent published the generation this
    survivor waits for; returns it. Exits PEER_LOST (the agent then restarts cold) after
    WAIT_S seconds."""
    assert _carry is not None
    key = f"{store_prefix()}/gen"
    deadline = time.monotonic() + WAIT_S
    reason = f"the launcher published no generation {_carry.generation} in {WAIT_S:g} s"
    failing_since = None
    while time.monotonic() < deadline:
        try:
            if _carry.store.check([key]) and int(bytes(_carry.store.get(key))) >= _carry.generation:
                _carry.timings["wait_generation_s"] = time.monotonic() - _carry.detected_at
                return _carry.generation
            failing_since = None
        except (RuntimeError, dist.DistError, ValueError) as e:
            # briefly unreachable: keep trying; gone (its host, the node of group rank 0's
            # agent, was lost): no generation can come, so say so now
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= _STORE_GONE_S:
                reason = f"the launcher's store is unreachable: {str(e)[:200]}"
                break
        time.sleep(0.005)
    get_logger().error(ev.RECOVERY_COLD, reason=reason)
    os._exit(int(ExitCode.PEER_LOST))


def roll_call(store: Any, rank: int, world: int, wd: WatchdogConfig) -> None:
    """Generation g >= 1, in init_distributed before its process groups form: say this rank
    arrived and wait until every rank did. Every rank of g calls it, survivors (re-running
    their script) and the replacement alike.

    Why: a rank that hangs on its way into the new generation (stopped, or stuck in the
    set-up code of the script it re-runs) would hold the others in the process group's
    rendezvous for `pg_timeout_s` (30 min), and no watchdog runs there yet to name it. A
    missing rank is named as the watchdog names one (runtime/verdict.py): after
    `heartbeat_timeout_s` when its process is stopped (SIGKILLed, when on this host and
    `kill_stopped`), after `startup_timeout_s` otherwise, as any set-up phase (it may be a
    replacement still starting, or a survivor in slow set-up code). This rank then exits
    PEER_LOST: a failure while the generation forms, so the agent restarts the group cold.
    Store traffic: one add per rank and one waiting key, whatever the world size."""
    gen = generation()
    prefix = f"{store_prefix()}/gen_{gen}/arrived"
    t0 = time.monotonic()
    try:
        store.set(f"{prefix}/{rank}", "1")
        if int(store.add(f"{prefix}/count", 1)) == world:
            store.set(f"{prefix}/all", "1")
    except (RuntimeError, dist.DistError) as e:
        _leave_forming(gen, f"the launcher's store failed: {str(e)[:200]}")
    while True:
        left = t0 + wd.startup_timeout_s - time.monotonic()
        look = max(0.1, min(wd.heartbeat_timeout_s, left))
        try:
            store.wait([f"{prefix}/all"], timedelta(seconds=look))
            return
        except (RuntimeError, dist.DistError):
            pass  # timed out (or the store failed: the look below says which)
        try:
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
            metas = _last_metas(store, gen - 1, missing)
        except (RuntimeError, dist.DistError) as e:
            _leave_forming(gen, f"the launcher's store failed: {str(e)[:200]}")
        if not missing:  # all arrived meanwhile; the last one's "all" is on its way
            continue
        host = socket.gethostname()
        named = [
            {"rank": r, "state": procinfo.process_state(metas.get(r, {}), host), **metas.get(r, {})}
            for r in missing
        ]
        stopped = [d for d in named if d["state"] == "stopped"]
        waited = time.monotonic() - t0
        if not stopped and waited < wd.startup_timeout_s:
            continue
        if wd.kill_stopped:
            for d in stopped:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(d["pid"]), signal.SIGKILL)
        what = ", ".join(f"{d['rank']} ({d['state']})" for d in named[:8])
        _leave_forming(
            gen, f"rank(s) {what} did not arrive for generation {gen} in {waited:.1f} s", named
        )


def _last_metas(store: Any, gen: int, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Host, pid and start time of `ranks` in generation `gen`, from its watchdog's keys."""
    attempt = os.environ.get(ENV_ATTEMPT, "0")
    out = {}
    for r in ranks[:64]:
        key = f"{worker_store_prefix(attempt, gen)}/{WATCHDOG_PREFIX}/meta/{r}"
        if store.check([key]):
            out[r] = json.loads(bytes(store.get(key)))
    return out


def _leave_forming(gen: int, reason: str, named: list[dict[str, Any]] | None = None) -> NoReturn:
    get_logger().error(ev.RECOVERY_COLD, reason=reason, generation=gen, named=named or [])
    from resilient.runtime.verdict import hard_exit

    hard_exit(ExitCode.PEER_LOST)


def mark_stepped(store: Any) -> None:
    """On rank 0, once the first step of a generation >= 1 closed: say so in the store. The
    agent holds back its next warm spare until then (supervisor/agent.py), so the spare's
    start does not take a core from the recovery's re-formation and first step."""
    if store is None:
        return
    # a store that fails here: the agent starts the spare after its deadline anyway
    with contextlib.suppress(RuntimeError, dist.DistError):
        store.set(f"{store_prefix()}/gen_{generation()}/stepped", "1")


# ---------------------------------------------------------------- every rank of the new generation
@dataclass(frozen=True)
class Resumed:
    step: int
    """The snapshot step every rank restored."""
    catch_up: bool
    """A durable save was lost with the peer and the replay will not make it again on the
    step schedule: every rank saves `step` before its first batch (otherwise each hot recovery
    during a save leaves the newest checkpoint one interval further behind, and a later cold
    fallback replays all of that)."""


def resume(rt: Runtime) -> Resumed | None:
    """In Runtime.resume() of generation g >= 1 (hot on): restore the newest snapshot step every
    rank can restore. Returns that step, or None to load from storage as a cold start would.
    Collectives on the control group: every rank of the generation calls it."""
    global _carry
    log = get_logger()
    t0 = time.monotonic()
    carry, _carry = _carry, None
    store = rt.ctx.base_store
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
        replica = _get_replica(store, rt.rank) if store is not None else {}
        mine = {"steps": sorted(replica), "survivor": False, "at": None, "lost": None}
    every: list[Any] = [None] * rt.world_size
    dist.all_gather_object(every, mine, group=rt.ctx.control_group)
    survivors = [r for r, m in enumerate(every) if m["survivor"]]
    sharded = any(every[r]["sharded"] for r in survivors)
    # where each replacement's state comes from: with DDP any survivor holds the model and
    # optimizer state, and its buddy (or, with replicas=0, the store) its per-rank part;
    # sharded state only its buddy
    source: dict[int, int] = {}
    part_from: dict[int, int] = {}  # replacement -> the survivor holding its per-rank part
    restorable: dict[int, set[int]] = {}
    for r, m in enumerate(every):
        if m["survivor"]:
            restorable[r] = set(m["steps"])
            continue
        holders = [s for s in survivors if every[s]["ward"] == r]
        if sharded:
            source[r] = holders[0] if holders else -1
            restorable[r] = set(every[holders[0]]["ward_steps"]) if holders else set()
        else:
            source[r] = survivors[0] if survivors else -1
            if holders:
                part_from[r] = holders[0]
            restorable[r] = set(every[holders[0]]["ward_steps"]) if holders else set(m["steps"])
    common = set.intersection(*restorable.values()) if restorable else set()
    target = max(common) if common and survivors else None
    if target is None:
        if rt.rank == 0:
            orphans = [r for r, src in source.items() if src < 0]
            log.error(
                ev.RECOVERY_COLD,
                reason=(
                    "sharded state, and no rank keeps a replica of another's "
                    "(snapshot replicas=0): a lost rank's shards are gone"
                    if sharded and all(every[s]["ward"] is None for s in survivors)
                    else f"the replica of rank(s) {orphans} was lost with them (their buddy too)"
                    if sharded and orphans
                    else "no snapshot step every rank can restore"
                ),
                held={str(r): sorted(steps) for r, steps in restorable.items()},
            )
        return None
    if carry is not None:
        sd = carry.buffers[target]
        for r, src in source.items():  # point to point, to each replacement
            if src == rt.rank and sharded:  # the ward's whole state, kept for it
                send_state(carry.replica[target], r, rt.ctx.control_group)
            elif src == rt.rank:  # the replicated model and optimizer state
                shared = {k: v for k, v in sd.items() if not k.startswith("rank")}
                send_state(shared, r, rt.ctx.control_group)
            if part_from.get(r) == rt.rank:  # and its own part, kept for it
                part = [carry.replica[target][f"rank{r}"]]
                dist.send_object_list(part, dst=r, group=rt.ctx.control_group)
    else:
        sd = recv_state(source[rt.rank], rt.ctx.control_group)
        if not sharded and rt.rank in part_from:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=part_from[rt.rank], group=rt.ctx.control_group)
            sd[f"rank{rt.rank}"] = box[0]
        elif not sharded:
            sd[f"rank{rt.rank}"] = replica[target]
    transfer_s = time.monotonic() - t0
    try:
        rt.state.apply(rehydrate(sd, rt.state.model), rank=rt.rank)
    except ValueError as e:  # a shard that does not fit this rank's parameters
        _cold(rt, f"the snapshot of step {target} does not fit the model here: {e}")
    del sd
    if carry is not None:
        carry.buffers.clear()
        carry.replica.clear()
    # the snapshot interval goes on where it was (the largest a survivor held: every rank
    # must snapshot at the same steps), not from every step again
    held_every = [int(every[r]["every"]) for r in survivors if every[r].get("every")]
    if held_every:
        rt.snapshots.adopt_interval(max(held_every), carry.interval if carry else None)
    lost = sorted({m["lost"] for m in every if m["lost"] is not None})
    # a lost save past the target is made again by the replay when the step policy saves there
    catch_up = any(s <= target or not rt.saves_on_schedule(s) for s in lost)
    fields: dict[str, Any] = {
        "to_step": target,
        "steps_lost": max(int(every[r]["at"]) for r in survivors) - target,
        "generation": generation(),
        "survivor": carry is not None,
        "from_rank": source.get(rt.rank, rt.rank),
        "part_from": None if carry is not None or sharded else part_from.get(rt.rank, "store"),
        "sharded": sharded,
        "transfer_s": round(transfer_s, 4),
        "restore_s": round(time.monotonic() - t0, 4),
        "lost_saves": lost,
        "catch_up_save": target if catch_up else None,
    }
    if carry is not None:
        fields.update({k: round(v, 4) for k, v in carry.timings.items()})
        fields["since_detect_s"] = round(time.monotonic() - carry.detected_at, 4)
    log.warning(ev.RECOVERY_HOT_FORMED, **fields)
    if rt.rank == 0 and store is not None:
        store.set(f"{store_prefix()}/gen_{generation()}/formed", "1")
    return Resumed(target, catch_up=catch_up)
