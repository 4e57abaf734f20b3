"""A run's events, read back from `<run_dir>/logs/*.jsonl` in time order, attempts numbered.

The analysis uses:
- `runtime.init` / `runtime.resume` (per attempt), `train.progress` (step windows with busy
  seconds), `ckpt.save.start` / `ckpt.save.staged` / `ckpt.save.committed` (save cost), and
  detection events (`hang.detected`, `fault.detected`, `watchdog.exit`, `guard.failure`, the
  supervisor's `worker.failed`).
- `chaos.fault` lines that the chaos harness writes to `logs/chaos.jsonl` give exact fault
  times; without them a fault's time is estimated as the last event of the failed attempt.

A preempted run is launched again with the same command, and each launch counts its
attempts from 0: they are renumbered here, so that `restart` counts attempts over the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resilient import events as ev

__all__ = ["load_events"]


def load_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of the run, each with a float `t` (epoch seconds), in time order."""
    out = []
    for e in ev.iter_events(Path(run_dir, "logs")):
        try:
            e["t"] = ev.timestamp(e)
        except (ValueError, KeyError, TypeError):
            continue  # no time: not ours
        out.append(e)
    out.sort(key=lambda e: e["t"])
    _number_attempts_across_launches(out)
    return out


def _number_attempts_across_launches(events: list[dict[str, Any]]) -> None:
    """Make `restart` count attempts over the whole run, in place.

    Within one launch `restart` is torch elastic's restart count, which misses two kinds of
    new attempt: a preemption ends the launch and the next launch (the same command again)
    counts from 0, and a membership change (a node joined) restarts the group without
    counting. Either way a rank's new process (not a hot replacement) comes with a count no
    higher than its last process's, and so starts a new segment for that rank; a supervisor's
    segment is that of the first rank process it started. Each segment is then offset by the
    attempts of the segments before it. Approximations kept: a rank that exists only after a
    grow counts its first segment as the run's first, and a supervisor's events after a
    membership change keep its first segment's numbering."""
    rank_launch: dict[tuple[Any, Any], int] = {}
    launches_of_rank: dict[Any, int] = {}
    last_count: dict[Any, int] = {}  # rank -> its newest process's restart count
    sup_launch: dict[Any, int] = {}
    waiting: list[Any] = []  # supervisors started since the last rank process
    most: dict[int, int] = {}  # segment -> highest restart seen in it
    least: dict[int, int] = {}  # segment -> lowest
    for e in events:
        if e.get("event") == "supervisor.start":
            if e.get("pid") not in sup_launch and e.get("pid") not in waiting:
                waiting.append(e.get("pid"))
            continue
        if e.get("event") != "runtime.init" or e.get("rank") is None:
            continue
        key = (e["rank"], e.get("pid"))
        if key in rank_launch:
            continue
        n = launches_of_rank.get(e["rank"], -1)
        count = int(e.get("restart", 0))
        # a hot replacement (generation > 0) is a new process in the same attempt
        if n < 0 or (int(e.get("generation") or 0) == 0 and count <= last_count[e["rank"]]):
            n += 1
        launches_of_rank[e["rank"]] = n
        last_count[e["rank"]] = count
        rank_launch[key] = n
        most[n] = max(most.get(n, 0), count)
        least[n] = min(least.get(n, count), count)
        for pid in waiting:  # a supervisor's segment: that of the first rank it started
            sup_launch[pid] = n
        waiting.clear()
    if len(most) < 2:
        return  # one launch: restart already counts every attempt
    offset: dict[int, int] = {}
    acc = 0
    for n in sorted(most):
        offset[n] = acc - least[n]
        acc += most[n] - least[n] + 1
    for e in events:
        if "restart" not in e:
            continue
        launch: int | None
        if e.get("rank") is not None:
            launch = rank_launch.get((e["rank"], e.get("pid")))
        elif e.get("source") == "supervisor":
            launch = sup_launch.get(e.get("pid"))
        else:
            launch = None
        if launch is not None and launch in offset:
            e["launch"] = launch
            e["restart"] = offset[launch] + int(e["restart"])
