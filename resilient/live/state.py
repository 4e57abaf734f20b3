"""The live state of a run, folded from its events one at a time (a pure reducer: no clock,
no files, no threads; the monitor feeds it what the follower reads).

What counts, and from which events (docs/metrics.md has the metric of each):
- a rank's step: steps it has completed (a `train.progress` window's last + 1), or where it
  resumed (`runtime.resume`); its last step's end time (the window's t1);
- step times: each progress window adds its n steps to the histogram at their mean body
  time busy_s / n (the runtime batches steps into windows of about a second: the spread of
  the steps inside one window is not seen);
- checkpoints: one save per (attempt, step) however many ranks log it, its seconds the
  slowest rank's, its bytes the manifest's total; loads the same way;
- recoveries, as `resilient report` tells them (report/recovery.py): a cold restart is a
  new attempt of the node's lead rank (its `runtime.init` with restart > 0, not a hot
  replacement's), hot ones are the lead rank's `recovery.hot.formed`, `rollback.done` and
  `oom.retry`. The lead is the lowest rank whose process started as local rank 0: rank 0
  on one node, every rank of a node logging the same recovery counts once;
- restarts and health checks: this host's supervisor log (`attempt.start` with restart > 0,
  `health.check`, `health.done`); another host's, in a shared run directory, is its own
  node's business;
- hangs: verdicts (`hang.detected`, a worker's or its agent's), and the learned timeouts
  rank 0 judges by (its newest `hang.timeouts`);
- stragglers: each rank's newest score (`straggler.scores`), and each time a rank is newly
  flagged (`straggler.detected`, however many watchdogs report it).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from resilient import events as ev
from resilient.hang.learned import table_of

__all__ = ["RECOVERY_KINDS", "STEP_BUCKETS", "HealthCheck", "LiveState", "RankState"]

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the step-time histogram's buckets; +Inf is added."""
RECOVERY_KINDS = ("cold_restart", "hot_replacement", "hot_rollback", "oom_retry")
_HOT = {
    ev.RECOVERY_HOT_FORMED: "hot_replacement",
    ev.ROLLBACK_DONE: "hot_rollback",
    ev.OOM_RETRY: "oom_retry",
}
_RATE_S = 30.0
"""Steps per second: over the lead rank's progress windows of the last this many seconds."""


@dataclass(slots=True)
class RankState:
    step: int | None = None
    """Steps completed (the next step it runs); where it resumed, after a resume."""
    last_step_t: float | None = None
    """Unix time its newest completed step ended."""
    steps_run: int = 0
    """Steps completed over the run, steps run again after a recovery included."""
    restart: int = 0
    straggler_score: float | None = None
    stragglers_detected: int = 0
    """Times this rank was newly flagged a straggler."""


@dataclass(slots=True)
class HealthCheck:
    ok: bool
    skipped: bool
    seconds: float
    value: float | None
    """The measured value when the check logged a number (most log a readable text)."""


@dataclass(slots=True)
class _Save:
    seconds: float
    bytes: float


@dataclass
class LiveState:
    host: str | None = None
    """This node's host name: other hosts' supervisor events are left out (None: none are)."""
    run_id: str | None = None
    world_size: int | None = None
    attempt: int = 0
    total_steps: int | None = None
    """The planned total, once an event of the lead rank says it (train.loop at the start of
    a step loop, runtime.done)."""
    ranks: dict[int, RankState] = field(default_factory=dict)
    lead: int | None = None
    step_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_count: int = 0
    step_sum: float = 0.0
    saves: dict[tuple[int, int], _Save] = field(default_factory=dict)
    save_seconds_sum: float = 0.0
    save_bytes_sum: float = 0.0
    last_save: _Save | None = None
    loads: dict[tuple[int, int], _Save] = field(default_factory=dict)
    load_seconds_sum: float = 0.0
    load_bytes_sum: float = 0.0
    last_load: _Save | None = None
    checkpoint_step: int | None = None
    """The newest committed checkpoint (the last committed in time)."""
    checkpoint_t: float | None = None
    restarts: int = 0
    recoveries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RECOVERY_KINDS, 0))
    hangs: int = 0
    hang_timeouts: dict[str, float] = field(default_factory=dict)
    """The learned timeouts every rank judges by, per phase (rank 0's newest hang.timeouts),
    and "heartbeat": rank 0's learned heartbeat timeout; one left out keeps its fixed one."""
    health: dict[str, HealthCheck] = field(default_factory=dict)
    health_ok: bool | None = None
    health_rounds: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    health_t: float | None = None
    last_event_t: float | None = None
    _windows: deque[tuple[float, float, int]] = field(default_factory=deque)
    """The lead rank's recent progress windows (t0, t1, steps), for steps per second."""
    _lead_inits: dict[int, int] = field(default_factory=dict)
    """rank -> local rank, from each rank's runtime.init."""
    _flagged: dict[int, int] = field(default_factory=dict)
    """Straggler rank -> the attempt it was flagged in (until cleared)."""

    def apply_all(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            self.apply(e)

    def apply(self, e: dict[str, Any]) -> None:
        """Fold in one event (with its float `t`, as the follower gives it)."""
        name = e.get("event")
        t = e.get("t")
        if isinstance(t, float | int):
            self.last_event_t = max(self.last_event_t or 0.0, float(t))
        if e.get("source") == "supervisor":
            if self.host is None or e.get("host") in (None, self.host):
                self._supervisor(str(name), e)
            return
        rank = e.get("rank")
        if name == ev.HANG_DETECTED:
            self.hangs += 1
        elif name == ev.HANG_TIMEOUTS and rank == 0:
            self.hang_timeouts = table_of(e)
        elif name == ev.STRAGGLER_DETECTED or name == "straggler.cleared":
            self._straggler(name, e)
        elif name == ev.STRAGGLER_SCORES:
            for r, score in dict(e.get("scores") or {}).items():
                self._rank(int(r)).straggler_score = float(score)
        if not isinstance(rank, int):
            return
        restart = int(e.get("restart") or 0)
        if name == ev.TRAIN_PROGRESS:
            self._progress(rank, restart, e)
        elif name == ev.RUNTIME_RESUME:
            r = self._rank(rank)
            r.step, r.restart = int(e["step"]), restart
            self._total(rank, e)
            if rank == self.lead:
                self._windows.clear()  # the rate restarts with the attempt
        elif name == ev.RUNTIME_INIT:
            self._init(rank, restart, e)
        elif name == ev.CKPT_SAVE_COMMITTED:
            self._save(restart, e)
        elif name == ev.CKPT_LOAD:
            self._load(restart, e)
        elif name in (ev.RUNTIME_DONE, ev.TRAIN_LOOP):
            self._total(rank, e)
        elif name in _HOT and rank == self.lead:
            self.recoveries[_HOT[str(name)]] += 1

    # ------------------------------------------------------------------ the ranks
    def _rank(self, rank: int) -> RankState:
        r = self.ranks.get(rank)
        if r is None:
            r = self.ranks[rank] = RankState()
        return r

    def _init(self, rank: int, restart: int, e: dict[str, Any]) -> None:
        self._rank(rank).restart = restart
        self._lead_inits[rank] = int(e.get("local_rank", 0) or 0)
        self.lead = min((r for r, lr in self._lead_inits.items() if lr == 0), default=None)
        self.run_id = e.get("run_id", self.run_id)
        if rank != self.lead:
            return
        if e.get("world_size") is not None:
            self.world_size = int(e["world_size"])
        self.attempt = restart
        self._total(rank, e)
        if restart > 0 and not int(e.get("generation") or 0):
            self.recoveries["cold_restart"] += 1

    def _total(self, rank: int, e: dict[str, Any]) -> None:
        if rank == self.lead and isinstance(e.get("total"), int):
            self.total_steps = int(e["total"])

    def _progress(self, rank: int, restart: int, e: dict[str, Any]) -> None:
        try:
            first, last = int(e["first"]), int(e["last"])
            t0, t1, busy = float(e["t0"]), float(e["t1"]), float(e["busy_s"])
        except (KeyError, TypeError, ValueError):
            return
        n = last - first + 1
        if n <= 0:
            return
        r = self._rank(rank)
        r.step, r.restart, r.steps_run = last + 1, restart, r.steps_run + n
        r.last_step_t = t1 if r.last_step_t is None else max(r.last_step_t, t1)
        per = busy / n
        self.step_buckets[bisect.bisect_left(STEP_BUCKETS, per)] += n
        self.step_count += n
        self.step_sum += busy
        if rank == self.lead:
            self._windows.append((t0, t1, n))
            while self._windows and self._windows[0][1] < t1 - _RATE_S:
                self._windows.popleft()

    def steps_per_second(self) -> float | None:
        """The lead rank's pace over its windows of the last 30 s of steps (None: fewer than
        two windows yet)."""
        if len(self._windows) < 2:
            return None
        span = self._windows[-1][1] - self._windows[0][0]
        steps = sum(n for _, _, n in self._windows)
        return steps / span if span > 0 else None

    def lead_step(self) -> int | None:
        """The lead rank's step, else the furthest rank's."""
        if self.lead is not None and self.lead in self.ranks:
            return self.ranks[self.lead].step
        steps = [r.step for r in self.ranks.values() if r.step is not None]
        return max(steps, default=None)

    def _straggler(self, name: object, e: dict[str, Any]) -> None:
        who = e.get("straggler")
        if not isinstance(who, int):
            return
        restart = int(e.get("restart") or 0)
        if name == "straggler.cleared":
            self._flagged.pop(who, None)
        elif self._flagged.get(who) != restart:
            self._flagged[who] = restart
            self._rank(who).stragglers_detected += 1

    # ------------------------------------------------------------------ checkpoints
    def _save(self, restart: int, e: dict[str, Any]) -> None:
        try:
            key = (restart, int(e["step"]))
            seconds, size = float(e.get("seconds") or 0.0), float(e.get("bytes") or 0.0)
        except (KeyError, TypeError, ValueError):
            return
        known = self.saves.get(key)
        if known is None:
            self.saves[key] = self.last_save = _Save(seconds, size)
            self.save_seconds_sum += seconds
            self.save_bytes_sum += size
        elif seconds > known.seconds:  # the save took as long as its slowest rank
            self.save_seconds_sum += seconds - known.seconds
            known.seconds = seconds
        t = e.get("t")
        if isinstance(t, float | int) and (self.checkpoint_t is None or t >= self.checkpoint_t):
            self.checkpoint_step, self.checkpoint_t = key[1], float(t)

    def _load(self, restart: int, e: dict[str, Any]) -> None:
        try:
            key = (restart, int(e["step"]))
            seconds, size = float(e.get("seconds") or 0.0), float(e.get("bytes") or 0.0)
        except (KeyError, TypeError, ValueError):
            return
        known = self.loads.get(key)
        if known is None:
            self.loads[key] = self.last_load = _Save(seconds, size)
            self.load_seconds_sum += seconds
            self.load_bytes_sum += size
        elif seconds > known.seconds:
            self.load_seconds_sum += seconds - known.seconds
            known.seconds = seconds

    # ------------------------------------------------------------------ the supervisor
    def _supervisor(self, name: str, e: dict[str, Any]) -> None:
        if name == "attempt.start" and int(e.get("restart") or 0) > 0:
            self.restarts += 1
        elif name == ev.HANG_DETECTED:  # its agent saw a worker stopped (supervisor/stopped.py)
            self.hangs += 1
        elif name == ev.HEALTH_CHECK and e.get("name"):
            value = e.get("value")
            self.health[str(e["name"])] = HealthCheck(
                ok=bool(e.get("ok")),
                skipped=bool(e.get("skipped")),
                seconds=float(e.get("seconds") or 0.0),
                value=float(value)
                if isinstance(value, int | float) and not isinstance(value, bool)
                else None,
            )
        elif name == ev.HEALTH_DONE:
            self.health_ok = bool(e.get("ok"))
            self.health_rounds["ok" if self.health_ok else "failed"] += 1
            t = e.get("t")
            self.health_t = float(t) if isinstance(t, float | int) else self.health_t
        elif name == "supervisor.start":
            self.run_id = e.get("run_id", self.run_id)
