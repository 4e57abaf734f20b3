"""Re-forming the group for a hot recovery's next generation: the wait and the roll call.

A survivor waits in the worker wrapper until the agent publishes the generation it needs
(`await_generation`). Then every rank of that generation, survivors re-running their script
and the replacement alike, says it arrived and waits for the others before its process groups
form (`roll_call`). A rank that does not come is named, as the watchdog names one
(hang/verdict.py), and the generation goes cold rather than wait out the process group's
30-minute rendezvous with no watchdog running yet. `judge_roll_call` is that rule alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from resilient import events as ev
from resilient import faultpoints, storekeys
from resilient.envvars import HotMode
from resilient.exitcodes import ExitCode
from resilient.groups.exits import hard_exit
from resilient.hang import procinfo
from resilient.hang.config import WatchdogConfig
from resilient.hot import carry
from resilient.hot.script_store import script_group_formed_without_me
from resilient.log import get_logger

__all__ = ["RollCallVerdict", "await_generation", "judge_roll_call", "mark_stepped", "roll_call"]

STORE_GONE_S = 3.0
"""How long the store may fail every call before a waiting survivor takes it for gone."""
_STORE_ERRORS = (RuntimeError, dist.DistError, ValueError)


def await_generation() -> int:
    """In the wrapper, after HotRestart: wait until the agent published the generation this
    survivor waits for; returns it. Exits PEER_LOST (the agent then restarts cold) after the
    carried wait."""
    held = carry.peek()
    assert held is not None
    key, deadline = held.keys.published(), time.monotonic() + held.wait_s
    reason = f"the launcher published no generation {held.generation} in {held.wait_s:g} s"
    failing_since = None
    while time.monotonic() < deadline:
        try:
            if held.store.check([key]) and int(bytes(held.store.get(key))) >= held.generation:
                held.timings["wait_generation_s"] = time.monotonic() - held.detected_at
                return held.generation
            failing_since = None
        except _STORE_ERRORS as e:
            # briefly unreachable: keep trying; gone (its host, the node of group rank 0's
            # agent, was lost): no generation can come, so say so now
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= STORE_GONE_S:
                reason = f"the launcher's store is unreachable: {str(e)[:200]}"
                break
        time.sleep(0.005)
    get_logger().error(ev.RECOVERY_COLD, reason=reason)
    os._exit(int(ExitCode.PEER_LOST))


@dataclass(frozen=True)
class RollCallVerdict:
    """The roll call gives up: kill `kill` (stopped processes on this host), then go cold."""

    reason: str
    kill: list[int]


def judge_roll_call(
    named: list[dict[str, Any]],
    *,
    waited_s: float,
    generation: int,
    wd: WatchdogConfig,
) -> RollCallVerdict | None:
    """The roll call's rule, given the missing ranks (`named`: rank, state as
    procinfo.process_state says it, pid) after `waited_s`. None: keep waiting.

    A stopped process cannot come: give up as soon as one is seen (the look is every
    `heartbeat_timeout_s`). Anything else may be a replacement still starting or a survivor
    in slow set-up code: give up after `startup_timeout_s`, as for any set-up phase."""
    stopped = [d for d in named if d.get("state") == "stopped"]
    if not stopped and waited_s < wd.startup_timeout_s:
        return None
    kill = [int(d["pid"]) for d in stopped if d.get("pid")] if wd.kill_stopped else []
    what = ", ".join(f"{d['rank']} ({d.get('state')})" for d in named[:8])
    return RollCallVerdict(
        f"rank(s) {what} did not arrive for generation {generation} in {waited_s:.1f} s", kill
    )


def roll_call(store: Any, rank: int, world: int, wd: WatchdogConfig, mode: HotMode) -> None:
    """Generation g >= 1, in init_distributed before its process groups form: say this rank
    arrived and wait until every rank did; exits PEER_LOST (the agent restarts the group
    cold) when one does not come (judge_roll_call). Store traffic: one add per rank and one
    waiting key, whatever the world size."""
    gen, keys = mode.generation, mode.keys
    faultpoints.hit(faultpoints.HOT_ROLL_CALL, generation=gen)
    t0 = time.monotonic()
    try:
        store.set(keys.arrived(gen, rank), "1")
        if int(store.add(keys.arrived(gen, "count"), 1)) == world:
            store.set(keys.arrived(gen, "all"), "1")
    except (RuntimeError, dist.DistError) as e:
        _leave_forming(gen, f"the launcher's store failed: {str(e)[:200]}")
    while True:
        left = t0 + wd.startup_timeout_s - time.monotonic()
        look = max(0.1, min(wd.heartbeat_timeout_s, left))
        try:
            store.wait([keys.arrived(gen, "all")], timedelta(seconds=look))
            return
        except (RuntimeError, dist.DistError):
            pass  # timed out (or the store failed: the look below says which)
        try:
            missing = [r for r in range(world) if not store.check([keys.arrived(gen, r)])]
            metas = _last_metas(store, mode, missing)
        except (RuntimeError, dist.DistError) as e:
            _leave_forming(gen, f"the launcher's store failed: {str(e)[:200]}")
        if not missing:  # all arrived meanwhile; the last one's "all" is on its way
            continue
        if script_group_formed_without_me(gen):
            _leave_forming(
                gen,
                f"rank(s) {missing[:8]} wait in the script's own init_process_group for "
                f"generation {gen}, which this rank's script did not call: a framework kept "
                "its process state across the hot re-run; restarting cold",
            )
        host = socket.gethostname()
        named = [
            {"rank": r, "state": procinfo.process_state(metas.get(r, {}), host), **metas.get(r, {})}
            for r in missing
        ]
        verdict = judge_roll_call(named, waited_s=time.monotonic() - t0, generation=gen, wd=wd)
        if verdict is None:
            continue
        for pid in verdict.kill:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _leave_forming(gen, verdict.reason, named)


def _last_metas(store: Any, mode: HotMode, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Host, pid and start time of `ranks` in the previous generation, from its watchdog."""
    out = {}
    for r in ranks[:64]:
        key = storekeys.watchdog_key(mode.attempt, mode.generation - 1, storekeys.meta(r))
        if store.check([key]):
            out[r] = json.loads(bytes(store.get(key)))
    return out


def _leave_forming(gen: int, reason: str, named: list[dict[str, Any]] | None = None) -> NoReturn:
    get_logger().error(ev.RECOVERY_COLD, reason=reason, generation=gen, named=named or [])
    hard_exit(ExitCode.PEER_LOST)


def mark_stepped(store: Any, mode: HotMode) -> None:
    """On rank 0, once the first step of a generation >= 1 closed: say so in the store. The
    agent holds back its next warm spare until then (supervisor/hot.py), so the spare's
    start does not take a core from the recovery's re-formation and first step."""
    if store is None:
        return
    # a store that fails here: the agent starts the spare after its deadline anyway
    with contextlib.suppress(RuntimeError, dist.DistError):
        store.set(mode.keys.stepped(mode.generation), "1")
