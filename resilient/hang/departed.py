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

Store traffic: one `append` per leaving survivor; one `check` per heartbeat period on a rank
whose main thread has not moved for `stuck_s`, nothing on the others.
"""

from __future__ import annotations

import json
import time
from typing import Any

from resilient import events as ev
from resilient import storekeys
from resilient.groups import sockets
from resilient.hang.phases import Progress
from resilient.log import get_logger

__all__ = ["Departures", "announce"]


def announce(store: Any, rank: int, step: int) -> None:
    """On a survivor about to leave its generation: say so, with its connections' endpoints.
    `store`: the generation's watchdog store."""
    line = {"rank": rank, "step": step, "endpoints": sockets.endpoints()}
    store.append(storekeys.LEFT, json.dumps(line) + "\n")


class Departures:
    """The waiting side, polled from the watchdog's thread."""

    def __init__(self, rank: int, stuck_s: float) -> None:
        self.rank = rank
        self.stuck_s = stuck_s
        self._done: set[int] = set()

    def poll(self, store: Any, progress: Progress) -> int:
        """Cut the connections to survivors that left, once the main thread is stuck;
        returns how many were cut now."""
        if time.monotonic() - progress.since < self.stuck_s:
            return 0
        if not store.check([storekeys.LEFT]):
            return 0
        gone: dict[int, set[tuple[str, int]]] = {}
        for raw in bytes(store.get(storekeys.LEFT)).decode().splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            r = int(line["rank"])
            if r != self.rank and r not in self._done:
                gone[r] = {(str(ip), int(port)) for ip, port in line["endpoints"]}
        if not gone:
            return 0
        self._done.update(gone)
        cut = sockets.sever(set().union(*gone.values()))
        get_logger().warning(
            ev.RECOVERY_HOT_SEVER,
            left=sorted(gone),
            sockets=cut,
            step=progress.step,
            phase=progress.phase.name.lower(),
            stuck_s=round(time.monotonic() - progress.since, 3),
        )
        return cut
