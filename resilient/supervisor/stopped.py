"""A worker that can no longer beat, seen by its own node's agent in seconds.

The workers' watchdog names a rank without heartbeats after `heartbeat_timeout_s` (30 s by
default): from another host a stopped process and a slow one look alike. On the worker's own
host the agent can tell: at each look at the group (`--monitor-interval`) it reads
/proc/<pid>/stat of its workers. A worker stopped (state T, SIGSTOP; t, stopped by a tracer)
or a zombie (Z: its main thread is gone while the process is not) for `STOPPED_AFTER_S` is
named at once with a verdict in the workers' store, as the watchdog would write it
(hang/verdict.py): kind no_heartbeat, exit code 81 (HANG), the named rank's state "stopped"
or "zombie". The agent claims it like any rank (one verdict per generation), SIGKILLs the
worker (it cannot exit by itself) and the others carry the verdict out as they would their
own: every rank exits 81 and the group restarts, or under hot recovery the others stay and
the agent replaces the lost one. The detection time is STOPPED_AFTER_S plus up to one
monitor interval, and the others see the verdict within one heartbeat interval.

An exited worker (the agent's own child) is not this module's: its exit is seen directly
(procs.peek_exit).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from resilient import events as ev
from resilient import storekeys
from resilient.exitcodes import ExitCode
from resilient.hang.heartbeat import RankStatus, decode_beats
from resilient.hang.phases import FLAG_FAILED, FLAG_MICRO_BACKWARD, FLAG_OOM, Phase
from resilient.supervisor.procs import peek_exit

__all__ = ["STOPPED_AFTER_S", "StoppedWorkers", "proc_state"]

STOPPED_AFTER_S = 1.0
"""How long a worker stays stopped or a zombie before it is named (a debugger's or a
profiler's brief stop passes)."""

_STATES = {"T": "stopped", "t": "stopped", "Z": "zombie"}


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, D, T, t, Z, ...); None when gone or
    unreadable (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    end = raw.rfind(b")")  # the command name may hold spaces and parentheses
    return raw[end + 2 : end + 3].decode() if end > 0 else None


class StoppedWorkers:
    """Names this node's stopped or zombie workers (module doc). `look` is called at every
    look of the agent at its group; `store` returns the workers' store of the round and its
    watchdog prefix, or raises when it cannot be reached."""

    def __init__(
        self,
        store: Callable[[WorkerGroup], tuple[Any, str]],
        on_event: Callable[..., None],
        *,
        hot: Callable[[], bool],
        after_s: float = STOPPED_AFTER_S,
    ) -> None:
        self._store = store
        self._on_event = on_event
        self._hot = hot
        self._after_s = after_s
        self._since: dict[int, float] = {}
        self._named: set[int] = set()

    def start_round(self) -> None:
        self._since, self._named = {}, set()

    def look(self, worker_group: WorkerGroup, pids: dict[int, int]) -> None:
        now = time.monotonic()
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if pid is None or pid in self._named:
                continue
            state = _STATES.get(proc_state(pid) or "")
            if state is None or peek_exit(pid) is not None:
                self._since.pop(pid, None)
                continue
            first = self._since.setdefault(pid, now)
            if now - first >= self._after_s:
                self._named.add(pid)
                self._name(worker_group, w, pid, state, now - first)

    def _name(self, worker_group: WorkerGroup, w: Any, pid: int, state: str, for_s: float) -> None:
        rank, world = int(w.global_rank), int(w.world_size)
        named: dict[str, Any] = {"rank": rank, "silent_s": round(for_s, 3)}
        named.update(timeout_kind="process_state", pid=pid, host=socket.gethostname(), state=state)
        reason = f"rank {rank} (pid {pid}) is {state} (/proc state), seen by its node's agent"
        verdict = {
            "kind": "no_heartbeat",
            "code": int(ExitCode.HANG),
            "ranks": [rank],
            "hot": self._hot() and world > 1,
            "named": [named],
            "blocked": [],
            "n_blocked": 0,
            "by": "agent",
            "reason": reason,
            "dump": [],
            "expect_acks": world - 1,
        }
        published = False
        try:
            store, prefix = self._store(worker_group)
            named.update(_last_beat(store, prefix, rank, for_s), state=state)
            if store.add(f"{prefix}/{storekeys.CLAIM}", 1) == 1:
                store.set(f"{prefix}/{storekeys.VERDICT}", json.dumps(verdict))
                published = True
        except Exception as e:  # no store: the kill alone takes the usual failure path
            self._on_event("watchdog.store_error", error=str(e)[:300])
        if published:
            fields = {k: v for k, v in verdict.items() if k not in ("code", "dump", "expect_acks")}
            self._on_event(ev.HANG_DETECTED, **fields, exit_code=int(ExitCode.HANG))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # each worker leads its own session
        self._on_event("watchdog.killed", rank=rank, pid=pid, state=state, verdict=published)


def _last_beat(store: Any, prefix: str, rank: int, for_s: float) -> dict[str, Any]:
    """`rank` as its last heartbeat described it (step, phase, a pipeline stage's action),
    in the watchdog's words (RankStatus)."""
    key = f"{prefix}/{storekeys.heartbeat(rank)}"
    if not store.check([key]):
        return {}
    (b,) = decode_beats(bytes(store.get(key)))
    flags = int(b["flags"])
    return RankStatus(
        rank=rank,
        step=int(b["step"]),
        phase=Phase(min(int(b["phase"]), int(Phase.CLOSED))).name.lower(),
        seq=int(b["seq"]),
        progress_age_s=float(b["age"]) + for_s,
        silent_s=for_s,
        timeout_s=math.nan,
        failed=bool(flags & FLAG_FAILED),
        oom=bool(flags & FLAG_OOM),
        timeout_kind="process_state",
        stage=int(b["stage"]),
        micro=int(b["micro"]),
        micro_backward=bool(flags & FLAG_MICRO_BACKWARD),
    ).as_dict()
