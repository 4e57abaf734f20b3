"""Timeouts learned from the run: each training phase's recent progress intervals, the timeout
they give, and the table every rank agrees on.

- `PhaseStats`: the main thread records, at each progress event of a warm step, how long the
  rank had been without progress in the phase it leaves (the quantity the detector compares
  with the timeout). A ring of the last `WINDOW` intervals per learned phase; a few list
  stores per phase change.
- `LearnedTimeouts`: from those, this rank's table, max(`learn_floor_s`, `learn_factor` x
  the phase's `learn_quantile` interval), at most the fixed timeout (the ceiling), once the
  rank has done `learn_warmup_steps` steps; NaN where unknown (not warm, too few samples, a
  phase that is never learned). The watchdog agrees the tables through the store (`agree`:
  the largest per phase, unknown while any rank's is), and rank 0's detector judges with the
  agreed one. A stateful extra of the common state: the agreed table travels in every
  checkpoint and hot snapshot, so a resumed or hot-replaced group judges with it from its
  first completed step on, not from the end of a new warm-up. A table saved on another world
  size is dropped (a resized mesh has other step times): warm-up again, with the ceiling.

- `BeatGaps`: the heartbeat timeout learned the same way from the gaps between the beats
  a monitor sees of ranks in learned phases (a rank on another host, whose process state no
  agent of ours can read): max(`heartbeat_learn_floor_s`, `learn_factor` x the gaps'
  `learn_quantile`), at most `heartbeat_timeout_s`. Each monitor learns it from what it sees
  (rank 0 of every rank, the others of rank 0), within seconds of a start, so it is neither
  agreed nor saved.

Only the training phases are learned. Start-up, checkpoint, eval and finish, a pinned phase
(`phase_timeouts_s`), the first step of an attempt and a one-off interval (FLAG_ONE_OFF:
an epoch's first batch) keep the fixed timeouts, so legitimately slow events do not fire.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from resilient import storekeys
from resilient.hang.config import WatchdogConfig
from resilient.hang.phases import LEARNED_PHASES, Phase, Progress

__all__ = [
    "MIN_SAMPLES",
    "WINDOW",
    "BeatGaps",
    "LearnedTimeouts",
    "PhaseStats",
    "agree",
    "table_of",
]

WINDOW = 512
"""Progress intervals kept per phase."""
MIN_SAMPLES = 10
"""A phase seen fewer times than this keeps its fixed timeout."""


class PhaseStats:
    """The last WINDOW progress intervals of each learned phase (main thread writes, the
    watchdog's thread reads: list stores and slices are atomic under the GIL)."""

    __slots__ = ("_bufs", "_n")

    def __init__(self) -> None:
        self._bufs: list[list[float] | None] = [
            [0.0] * WINDOW if p in LEARNED_PHASES else None for p in Phase
        ]
        self._n = [0] * len(Phase)

    def add(self, phase: int, seconds: float) -> None:
        buf = self._bufs[phase]
        if buf is not None:
            n = self._n[phase]
            buf[n % WINDOW] = seconds
            self._n[phase] = n + 1

    def count(self, phase: Phase) -> int:
        return self._n[phase]

    def quantile(self, phase: Phase, q: float) -> float | None:
        """The `q` quantile of the phase's recent intervals; None with fewer than MIN_SAMPLES."""
        buf, n = self._bufs[phase], min(self._n[phase], WINDOW)
        if buf is None or n < MIN_SAMPLES:
            return None
        return float(np.quantile(np.asarray(buf[:n], dtype=np.float64), q))


class BeatGaps:
    """The last WINDOW gaps between two beats a monitor saw of ranks in learned phases, and
    the heartbeat timeout they give (module doc); `timeout` is NaN until MIN_SAMPLES gaps."""

    PER_LOOK = 64
    """Gaps kept from one look (a look at 16,384 ranks sees as many)."""

    def __init__(self, config: WatchdogConfig) -> None:
        self.factor, self.q = config.learn_factor, config.learn_quantile
        self.floor = float(config.heartbeat_learn_floor_s or 0.0)
        self.ceiling = config.heartbeat_timeout_s
        self._buf = np.zeros(WINDOW, dtype=np.float64)
        self._n = 0
        self.timeout = math.nan

    def add(self, gaps: np.ndarray) -> None:
        gaps = gaps[: self.PER_LOOK]
        if not gaps.size:
            return
        idx = (self._n + np.arange(gaps.size)) % WINDOW
        self._buf[idx] = gaps
        self._n += gaps.size
        n = min(self._n, WINDOW)
        if n >= MIN_SAMPLES:
            learned = self.factor * float(np.quantile(self._buf[:n], self.q))
            self.timeout = min(self.ceiling, max(self.floor, learned))


def agree(tables: list[np.ndarray]) -> np.ndarray:
    """The table every rank judges by: per phase the largest of the ranks' tables (so the
    slowest rank's pace sets it), NaN (the fixed timeout) while any rank's is unknown."""
    return np.max(np.stack(tables), axis=0)


def table_of(event: dict[str, Any]) -> dict[str, float]:
    """A `hang.timeouts` event's learned timeouts (LearnedTimeouts.fields): per phase, and
    "heartbeat" when the heartbeat timeout was learned."""
    table = {str(k): float(v) for k, v in dict(event.get("timeouts_s") or {}).items()}
    if event.get("heartbeat_timeout_s") is not None:
        table["heartbeat"] = float(event["heartbeat_timeout_s"])
    return table


class LearnedTimeouts:
    """This rank's learned table and the agreed one (module doc). A stateful extra of the
    common state (`state_dict`/`load_state_dict`)."""

    def __init__(self, config: WatchdogConfig, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.ceiling, _ = config.phase_timeouts()
        self.floor = float(config.learn_floor_s or 0.0)
        pinned = config.pinned()
        self.learnable = tuple(p for p in LEARNED_PHASES if p not in pinned)
        self.restored = np.full(len(Phase), math.nan)
        """From the checkpoint this attempt resumed from (NaN: none, or another world size)."""
        self.agreed = np.full(len(Phase), math.nan)
        """The agreed table (rank 0 computes it; the others read it back for their saves)."""
        self.heartbeat_s = math.nan
        """Rank 0's learned heartbeat timeout (BeatGaps), as last logged."""

    def local(self, stats: PhaseStats, steps_done: int) -> np.ndarray:
        """This rank's table: learned where warm with enough samples, else the restored one."""
        out = self.restored.copy()
        cfg = self.config
        if not cfg.learn_timeouts:
            return np.full(len(Phase), math.nan)
        if steps_done < cfg.learn_warmup_steps:
            return out
        for p in self.learnable:
            q = stats.quantile(p, cfg.learn_quantile)
            if q is not None:
                out[p] = min(self.ceiling[p], max(self.floor, cfg.learn_factor * q))
        return out

    def adopt(self, table: np.ndarray) -> bool:
        """Take `table` as the agreed one; True when it moved by more than 10 % anywhere (or
        became known or unknown somewhere): worth an event."""
        old, self.agreed = self.agreed, np.asarray(table, dtype=np.float64).copy()
        known_old, known_new = np.isfinite(old), np.isfinite(self.agreed)
        if (known_old != known_new).any():
            return True
        both = known_old & known_new
        return bool((np.abs(self.agreed[both] - old[both]) > 0.1 * old[both]).any())

    def adopt_heartbeat(self, seconds: float) -> bool:
        """Take rank 0's learned heartbeat timeout (NaN: none yet); True when it became known
        or moved by more than 10 %: worth an event."""
        old, self.heartbeat_s = self.heartbeat_s, seconds
        if math.isfinite(old) != math.isfinite(seconds):
            return True
        return math.isfinite(old) and abs(seconds - old) > 0.1 * old

    def fields(self) -> dict[str, Any]:
        """The `hang.timeouts` event's table: the agreed one by phase, and the learned
        heartbeat timeout (None: the fixed one rules)."""
        hb = round(self.heartbeat_s, 3) if math.isfinite(self.heartbeat_s) else None
        return {"timeouts_s": self.named(), "heartbeat_timeout_s": hb}

    def named(self, table: np.ndarray | None = None) -> dict[str, float]:
        """{phase name: seconds} of the known entries of `table` (default: the agreed one)."""
        t = self.agreed if table is None else table
        return {Phase(p).name.lower(): round(float(t[p]), 3) for p in Phase if np.isfinite(t[p])}

    def exchange(
        self, store: Any, rank: int, progress: Progress, world_size: int
    ) -> np.ndarray | None:
        """One agreement through the watchdog's store: publish this rank's table; rank 0
        returns every rank's agreed (`agree`) and publishes it, the others read it back (for
        their saves) and return None."""
        assert progress.stats is not None
        mine = self.local(progress.stats, progress.steps_done)  # type: ignore[arg-type]
        store.set(storekeys.learned(rank), mine.tobytes())
        if rank != 0:
            if store.check([storekeys.LEARNED_AGREED]):
                self.adopt(np.frombuffer(store.get(storekeys.LEARNED_AGREED), dtype=np.float64))
            return None
        raw = store.multi_get([storekeys.learned(r) for r in range(world_size)])
        # a rank that has not published since it resumed (its table is 2 s old at most) has
        # the checkpoint's table too, which every rank agreed on when it was saved
        tables = [np.frombuffer(b, dtype=np.float64) for b in raw]
        agreed = agree([np.where(np.isnan(t), self.restored, t) for t in tables])
        store.set(storekeys.LEARNED_AGREED, agreed.tobytes())
        return agreed

    # ------------------------------------------------------------------ stateful
    def state_dict(self) -> dict[str, Any]:
        return {"timeouts": self.named(), "world_size": self.world_size}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.restored = np.full(len(Phase), math.nan)
        if int(sd.get("world_size", -1)) != self.world_size:
            return  # another world size, another pace: learn again
        pinned = self.config.pinned()
        for name, value in dict(sd.get("timeouts", {})).items():
            phase = Phase[name.upper()] if name.upper() in Phase.__members__ else None
            if phase in self.learnable and phase not in pinned:
                floor = max(self.floor, float(value))
                self.restored[phase] = min(float(self.ceiling[phase]), floor)
        self.agreed = self.restored.copy()
