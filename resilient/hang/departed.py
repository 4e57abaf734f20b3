"""Survivors that left a generation, and the ranks still waiting on them in a collective.

A survivor that meets a lost peer leaves its generation for the next one without exiting
(hot/recovery.py). On a mesh, another survivor may be waiting in a sub-group collective on
that survivor rather than on the lost rank (HSDP: rank 0's replicate all-reduce with rank 2,
while rank 2 met rank 3's loss in their shard group and left). Its connections stay open, so
the wait would end only with the process group's timeout. `announce` is the leaving
survivor's side: it appends its rank and its connections' local endpoints to the watchdog's
`left` key. `Departures.poll` is the waiting rank's watchdog thread: once the main thread has
not moved for `stuck_s`, it looks for that key and cuts this process's connections to those
endpoints (groups/sockets.py). The collective fails as on a lost peer, and the rank goes hot
the usual way, announcing itself in turn, so a chain of waits unwinds one link at a time.

A chain needs a first link: a survivor that leaves. In some runs none does, because every
survivor waits on another survivor, none on the lost rank (HSDP or dp x tp, rank 3 killed
while an async save was in flight: rank 0's save thread met the loss in the checkpoint
group's gather and gave up, ranks 1 and 2's save threads went on waiting there for rank 0;
their main threads met the loss too, but leaving the loop waits for the save in flight, so
they never got to leave; rank 0's main thread waited in a sub-group collective on them). So
the agent's start of the next generation (`lost`, the launcher's published generation) is a
trigger of its own: a rank whose main thread has not moved for `stuck_s` once its generation
is over appends itself to the same key (`stuck: true`) and cuts its connections to every
rank there. All the waiting survivors do so, their waits on each other fail, and each goes
hot within a few heartbeat periods of the loss, instead of waiting out the hot verdict's
`wait_s` into a cold restart.

Store traffic: one `append` per leaving or stuck survivor; on a rank whose main thread has
not moved for `stuck_s`, one `check` of the key per heartbeat period and one `check` of the
published generation until it says so; nothing on the others.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from resilient import events as ev
from resilient import storekeys
from resilient.envvars import HotMode
from resilient.groups import sockets
from resilient.hang.phases import Progress
from resilient.log import get_logger

__all__ = ["Departures", "announce", "generation_over"]


def announce(store: Any, rank: int, step: int, *, stuck: bool = False) -> None:
    """On a survivor about to leave its generation, or stuck in it once it is over (`stuck`):
    say so, with its connections' endpoints. `store`: the generation's watchdog store."""
    line = {"rank": rank, "step": step, "endpoints": sockets.endpoints(), "stuck": stuck}
    store.append(storekeys.LEFT, json.dumps(line) + "\n")


def generation_over(launcher: Any, hot: HotMode) -> Callable[[], bool]:
    """`Departures.lost` for a Runtime in generation `hot.generation`: whether the agent
    published a later one (the key survivors wait on in hot/reform.py). `launcher`: a client
    of the launcher's store, without the generation's prefix."""
    key, later = hot.keys.published(), hot.generation + 1

    def lost() -> bool:
        return bool(launcher.check([key])) and int(bytes(launcher.get(key))) >= later

    return lost


class Departures:
    """The waiting side, polled from the watchdog's thread (and, on a survivor draining its
    save on its way out, from the drain: two leavers' save threads may wait on each other).
    `lost`: whether the agent started the generation after this one (None: not known here,
    e.g. without hot recovery)."""

    def __init__(self, rank: int, stuck_s: float, lost: Callable[[], bool] | None = None) -> None:
        self.rank = rank
        self.stuck_s = stuck_s
        self.lost = lost
        self._said = False
        self._cut: set[tuple[str, int]] = set()

    def poll(self, store: Any, progress: Progress) -> int:
        """Once the main thread is stuck: say so if the generation is over, and cut the
        connections to the survivors that left or said so; returns how many were cut now."""
        stuck_s = time.monotonic() - progress.since
        if stuck_s < self.stuck_s:
            return 0
        if not self._said and self.lost is not None and self.lost():
            self._said = True
            announce(store, self.rank, progress.step, stuck=True)
            get_logger().warning(
                ev.RECOVERY_HOT_STUCK,
                step=progress.step,
                phase=progress.phase.name.lower(),
                stuck_s=round(stuck_s, 3),
            )
        return self.cut(store, progress)

    def cut(self, store: Any, progress: Progress) -> int:
        """Cut this process's connections to the survivors that left or said they are stuck
        (those not cut yet); returns how many were cut now. Also a leaving survivor's, while
        it drains its own save (Watchdog.cut_departed)."""
        if not store.check([storekeys.LEFT]):
            return 0
        gone: dict[int, set[tuple[str, int]]] = {}
        stuck: set[int] = set()
        for raw in bytes(store.get(storekeys.LEFT)).decode().splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            r = int(line["rank"])
            new = {(str(ip), int(port)) for ip, port in line["endpoints"]} - self._cut
            if r != self.rank and new:
                gone.setdefault(r, set()).update(new)
                if line.get("stuck"):
                    stuck.add(r)
        if not gone:
            return 0
        remote = set().union(*gone.values())
        self._cut |= remote
        cut = sockets.sever(remote)
        get_logger().warning(
            ev.RECOVERY_HOT_SEVER,
            left=sorted(gone),
            stuck=sorted(stuck),
            sockets=cut,
            step=progress.step,
            phase=progress.phase.name.lower(),
            stuck_s=round(time.monotonic() - progress.since, 3),
        )
        return cut
