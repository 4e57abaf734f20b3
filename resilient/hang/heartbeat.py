"""Heartbeats and the hang detector: what each rank publishes (its wire format), and the logic
that judges it.

Pure logic: no thread, no store, no torch.distributed (the watchdog in watchdog.py runs it).

Two signals, two failure modes:
- liveness: a daemon thread bumps the beat counter every `heartbeat_interval_s`, also while the
  main thread is blocked in C++ (a gloo collective releases the GIL). No new beat for
  `heartbeat_timeout_s` means the process is dead or stopped (SIGSTOP); for a rank whose
  last beat was in a learned phase, the heartbeat timeout learned from the gaps between its
  beats (hang/learned.py `BeatGaps`, 10 s by default) once known.
- progress: the main thread moves through phases (data, forward, backward, optimizer, ...).
  The culprits of a stall are the live ranks furthest behind (lowest progress sequence
  number: in a DDP hang the sleeper is still in `forward` while its peers wait in
  `backward`); they are named once their progress is older than their own phase's timeout:
  the fixed one, or the learned one every rank agreed on (hang/learned.py, `set_learned`)
  while every live rank is in a learned phase.

Ages are measured by each rank on its own monotonic clock and aged further by the monitor's
clock from when it saw the beat, so clocks never need to agree across hosts. A rank's age
is known as of the monitor's look at its newest beat, so it is never overestimated: a stall
is never named before its timeout.
Each `update()` also says when the next timeout would fall due (`Report.due_s`); the
watchdog looks closely around then, so a stall is named within one close look (0.05 s at
most) of its timeout, not one heartbeat interval later.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from resilient.hang.config import ENV_WATCHDOG, WatchdogConfig
from resilient.hang.learned import BeatGaps
from resilient.hang.phases import (
    FLAG_FAILED,
    FLAG_HELD,
    FLAG_MICRO_BACKWARD,
    FLAG_ONE_OFF,
    FLAG_OOM,
    FLAG_WARM,
    LEARNED_PHASES,
    Phase,
    Progress,
)

__all__ = [
    "BEAT_DTYPE",
    "ENV_WATCHDOG",
    "FLAG_FAILED",
    "FLAG_OOM",
    "FLAG_WARM",
    "Detection",
    "HangDetector",
    "Phase",
    "Progress",
    "RankStatus",
    "Report",
    "Straggler",
    "WatchdogConfig",
    "decode_beats",
    "encode_beat",
    "straggler_scores",
]

_BEAT = struct.Struct("<IIqBBffbh")
BEAT_DTYPE = np.dtype(
    [
        ("beat", "<u4"),
        ("seq", "<u4"),
        ("step", "<i8"),
        ("phase", "u1"),
        ("flags", "u1"),
        ("age", "<f4"),
        ("local", "<f4"),
        ("stage", "i1"),
        ("micro", "<i2"),
    ]
)
assert BEAT_DTYPE.itemsize == _BEAT.size


def encode_beat(beat: int, progress: Progress, now: float | None = None) -> bytes:
    """29 bytes: beat counter, progress seq, step, phase, flags, progress age, local s/step,
    pipeline stage and micro-batch (-1: none)."""
    now = time.monotonic() if now is None else now
    return _BEAT.pack(
        beat & 0xFFFFFFFF,
        progress.seq & 0xFFFFFFFF,
        progress.step,
        int(progress.phase),
        progress.flags,
        max(0.0, now - progress.since),
        progress.local_ema,
        max(-1, min(progress.stage, 127)),
        max(-1, min(progress.micro, 32767)),
    )


def decode_beats(payloads: Sequence[bytes] | bytes) -> np.ndarray:
    """Heartbeat payloads (as a store's multi_get returns them) to a BEAT_DTYPE array."""
    buf = payloads if isinstance(payloads, bytes) else b"".join(payloads)
    if len(buf) % BEAT_DTYPE.itemsize:
        raise ValueError(f"heartbeat payloads of {len(buf)} bytes: not {BEAT_DTYPE.itemsize}-sized")
    return np.frombuffer(buf, dtype=BEAT_DTYPE)


@dataclass(frozen=True, slots=True)
class RankStatus:
    """What the monitor knows of one rank at detection time."""

    rank: int
    step: int
    phase: str
    seq: int
    progress_age_s: float
    """Time since its last progress (its clock, then ours since we saw the beat)."""
    silent_s: float
    """Time since we last saw a new heartbeat from it."""
    timeout_s: float
    failed: bool
    oom: bool
    timeout_kind: str = "fixed"
    """Which timeout applied: learned, fixed (the ceiling), pinned (phase_timeouts_s),
    first_step or startup."""
    stage: int = -1
    """Its pipeline stage (-1: not pipelined)."""
    micro: int = -1
    """The micro-batch of its pipeline stage's phase (-1: none)."""
    micro_backward: bool = False
    """That micro-batch is in its backward (else its forward, or just after it)."""
    heartbeat_timeout_s: float = math.inf
    """How long it may go without a beat: the learned heartbeat timeout while its last beat
    was in a learned phase (hang/learned.py BeatGaps), else `heartbeat_timeout_s`."""
    heartbeat_timeout_kind: str = "fixed"

    @property
    def action(self) -> str | None:
        """A pipeline stage's schedule action: "forward of micro-batch 2", "backward of
        micro-batch 0", "after the forward of micro-batch 3" (sending its activations or
        waiting for the next input); None: not pipelined, or no micro-batch in this step."""
        if self.stage < 0 or self.micro < 0 or self.phase not in ("forward", "backward"):
            return None
        if self.micro_backward:
            return f"backward of micro-batch {self.micro}"
        if self.phase == "forward":
            return f"forward of micro-batch {self.micro}"
        return f"after the forward of micro-batch {self.micro}"

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["micro_backward"]
        if self.stage >= 0:
            d["action"] = self.action
        else:
            del d["stage"], d["micro"]
        for k in ("progress_age_s", "silent_s", "timeout_s", "heartbeat_timeout_s"):
            d[k] = round(d[k], 3) if math.isfinite(d[k]) else None
        return d


@dataclass(frozen=True, slots=True)
class Detection:
    """Why the group must stop: `kind` is stalled, no_heartbeat or failed."""

    kind: str
    ranks: tuple[int, ...]
    """The ranks named as the cause."""
    details: tuple[RankStatus, ...]
    blocked: tuple[int, ...]
    """Other ranks past their own timeout (waiting on the named ones, most likely)."""


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    step: int
    local_s: float
    median_s: float
    cleared: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    detection: Detection | None
    stragglers: tuple[Straggler, ...] = ()
    due_s: float = math.inf
    """Seconds until the earliest watched rank would pass a timeout (its progress timeout,
    or the heartbeat timeout) if nothing moves: the monitor looks again closely then."""


class HangDetector:
    """Judges the heartbeats of `watch` ranks, one `update()` per monitor period.

    `liveness_only` checks heartbeats but not progress (a non-zero rank watching rank 0: a
    stalled rank 0 is still monitored by its own thread). `clock` is injectable for tests.
    """

    def __init__(
        self,
        config: WatchdogConfig,
        watch: Sequence[int],
        *,
        liveness_only: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.ranks = np.asarray(watch, dtype=np.int64)
        self.liveness_only = liveness_only
        self._clock = clock
        n = len(self.ranks)
        self._beat = np.zeros(n, dtype=np.uint32)
        self._seen = np.full(n, clock(), dtype=np.float64)
        self._age = np.zeros(n, dtype=np.float64)
        self._warm_t, self._cold_t = config.phase_timeouts()
        self._first_t = config.first_step_timeouts()
        self._pinned = np.zeros(len(Phase), dtype=bool)
        self._pinned[list(config.pinned())] = True
        self._training = np.zeros(len(Phase), dtype=bool)
        self._training[list(LEARNED_PHASES)] = True
        self._learnable = self._training & ~self._pinned
        self._learned_t = self._warm_t.copy()
        self._learned = np.zeros(len(Phase), dtype=bool)
        self._excused_at = -math.inf
        """When a rank was last seen in a phase whose timeout is not learned (update)."""
        """Phases whose warm timeout is learned now (set_learned)."""

        self._gaps = BeatGaps(config) if config.learn_timeouts else None
        """The beat gaps of ranks in learned phases: the learned heartbeat timeout."""
        self._steady = np.zeros(n, dtype=bool)
        """Each rank's last beat was in a learned phase (warm, not a one-off)."""
        self._strag_count = np.zeros(n, dtype=np.int64)
        self._strag_flagged = np.zeros(n, dtype=bool)
        self._strag_step = -1

    def set_learned(self, table: np.ndarray) -> None:
        """Judge warm ranks in learned phases by `table` (agreed by every rank; NaN: the
        fixed timeout), never above the fixed one (hang/learned.py)."""
        t = np.asarray(table, dtype=np.float64)
        self._learned = self._learnable & np.isfinite(t)
        self._learned_t = np.where(self._learned, np.minimum(t, self._warm_t), self._warm_t)

    @property
    def heartbeat_learned_s(self) -> float:
        """The heartbeat timeout learned from the beats' gaps (NaN: not yet, or not learning)."""
        return self._gaps.timeout if self._gaps is not None else math.nan

    def update(self, payloads: Sequence[bytes] | bytes, now: float | None = None) -> Report:
        """Fold in one round of heartbeats (in `watch` order) and judge them."""
        beats = decode_beats(payloads)
        if len(beats) != len(self.ranks):
            raise ValueError(f"{len(beats)} heartbeats for {len(self.ranks)} watched ranks")
        now = self._clock() if now is None else now
        phase = np.minimum(beats["phase"], int(Phase.CLOSED))
        active = phase != Phase.CLOSED
        flags = beats["flags"]
        warm = (flags & FLAG_WARM) != 0
        one_off = (flags & (FLAG_ONE_OFF | FLAG_HELD)) != 0
        fresh = beats["beat"] != self._beat
        steady = active & warm & self._training[phase] & ~one_off
        if self._gaps is not None:  # a gap per beat: two beats between two looks, two gaps
            kept = fresh & steady & self._steady
            n_beats = (beats["beat"][kept] - self._beat[kept]).astype(np.float64)
            self._gaps.add((now - self._seen[kept]) / n_beats)
        self._steady = steady
        self._beat = beats["beat"].copy()
        self._seen[fresh] = now
        self._age[fresh] = beats["age"][fresh]
        silent = now - self._seen
        hb_learned = math.isfinite(self.heartbeat_learned_s)
        hb_limit = np.where(
            steady & hb_learned, self.heartbeat_learned_s, self.config.heartbeat_timeout_s
        )
        dead = active & (silent > hb_limit)
        # before the first step began (step -1): start-up; inside it: the first step's
        # allowance, so a stall right after a resume is named in the first-step timeout
        cold = np.where(beats["step"] >= 0, self._first_t[phase], self._cold_t[phase])
        # learned timeouts hold while every live rank is in a learned phase: a rank in a
        # legitimately long one (a checkpoint, an eval, a one-off, or a phase its block's
        # code passes through: FLAG_HELD) may hold the others in a collective, and they wait
        # with the fixed timeouts until it is back
        learned = self._learned[phase] & ~one_off & warm
        if (active & (~self._training[phase] | one_off | ~warm)).any():
            learned = np.zeros_like(learned)
            self._excused_at = now
        limit = np.where(warm, np.where(learned, self._learned_t[phase], self._warm_t[phase]), cold)
        progress_age = self._age + silent
        # ...and a rank that waited on such a peer is judged by them from when it came back
        # (the detector's last look at it), not from when it began waiting
        age = np.where(learned, np.minimum(progress_age, now - self._excused_at), progress_age)
        # a beat overdue by two periods: the rank is probably stopped or dead
        quiet = active & (silent > 2 * self.config.heartbeat_interval_s)
        live_left = (hb_limit - silent)[quiet & ~dead]
        due = float(live_left.min()) if live_left.size else math.inf
        if dead.any():
            named, kind = dead, "no_heartbeat"
            blocked = np.zeros_like(dead)
        elif self.liveness_only:
            return Report(None, due_s=due)
        else:
            # a quiet rank's stale progress says nothing: wait for its beat or for the
            # heartbeat timeout
            over = active & ~quiet & (age > limit)
            left = (limit - age)[active & ~quiet & ~over]
            if left.size:
                due = min(due, float(left.min()))
            if not over.any():
                return Report(None, self._stragglers(beats, active & warm), due_s=due)
            if quiet.any():
                return Report(None, due_s=due)
            live = active & ~quiet
            failed = live & ((flags & FLAG_FAILED) != 0)
            if failed.any():
                named, kind = failed, "failed"
            else:
                # The culprits are the ranks furthest behind (every rank runs the same
                # sequence of phases); they are named once past their *own* timeout, so a
                # long phase (eval, checkpoint) keeps its budget while peers wait on it.
                seq = beats["seq"]
                named, kind = live & (seq == seq[live].min()) & over, "stalled"
                if not named.any():
                    return Report(None, due_s=due)
            blocked = over & ~named

        def kind_of(i: int) -> str:
            if not warm[i]:
                return "first_step" if beats["step"][i] >= 0 else "startup"
            if learned[i]:
                return "learned"
            return "pinned" if self._pinned[phase[i]] else "fixed"

        def status(i: int) -> RankStatus:
            return RankStatus(
                rank=int(self.ranks[i]),
                step=int(beats["step"][i]),
                phase=Phase(int(phase[i])).name.lower(),
                seq=int(beats["seq"][i]),
                progress_age_s=float(progress_age[i]),
                silent_s=float(silent[i]),
                timeout_s=float(limit[i]),
                failed=bool(flags[i] & FLAG_FAILED),
                oom=bool(flags[i] & FLAG_OOM),
                timeout_kind=kind_of(i),
                stage=int(beats["stage"][i]),
                micro=int(beats["micro"][i]),
                micro_backward=bool(flags[i] & FLAG_MICRO_BACKWARD),
                heartbeat_timeout_s=float(hb_limit[i]),
                heartbeat_timeout_kind="learned" if steady[i] and hb_learned else "fixed",
            )

        idx = np.flatnonzero(named)
        return Report(
            Detection(
                kind=kind,
                ranks=tuple(int(r) for r in self.ranks[idx]),
                details=tuple(status(int(i)) for i in idx[:64]),
                blocked=tuple(int(r) for r in self.ranks[np.flatnonzero(blocked)]),
            )
        )

    def _stragglers(self, beats: np.ndarray, ready: np.ndarray) -> tuple[Straggler, ...]:
        factor = self.config.straggler_factor
        if factor is None or self.liveness_only or ready.sum() < 2:
            return ()
        step = int(beats["step"][ready].min())
        if step <= self._strag_step:  # judge once per period in which every rank advanced
            return ()
        self._strag_step = step
        local = beats["local"].astype(np.float64)
        median = float(np.median(local[ready]))
        over = ready & (local > factor * median) & (median > 0)
        self._strag_count = np.where(over, self._strag_count + 1, 0)
        new = over & (self._strag_count >= self.config.straggler_patience) & ~self._strag_flagged
        cleared = self._strag_flagged & ~over & ready
        self._strag_flagged = (self._strag_flagged | new) & ~cleared
        out = [
            Straggler(int(self.ranks[i]), int(beats["step"][i]), float(local[i]), median)
            for i in np.flatnonzero(new)
        ]
        out += [
            Straggler(int(self.ranks[i]), int(beats["step"][i]), float(local[i]), median, True)
            for i in np.flatnonzero(cleared)
        ]
        return tuple(out)


def straggler_scores(payloads: Sequence[bytes], ranks: Sequence[int]) -> dict[int, float]:
    """Each warm, active rank's straggler score: the median rank's time per step in local
    phases over its own (1.0: the median's pace, 0.5: twice as slow). Ranks not yet warm
    (no local time measured) are left out; so is everything while fewer than two are warm."""
    beats = decode_beats(payloads)
    local = beats["local"].astype(np.float64)
    ready = (
        (np.minimum(beats["phase"], int(Phase.CLOSED)) != Phase.CLOSED)
        & ((beats["flags"] & FLAG_WARM) != 0)
        & (local > 0)
    )
    if ready.sum() < 2:
        return {}
    median = float(np.median(local[ready]))
    return {int(ranks[int(i)]): median / float(local[i]) for i in np.flatnonzero(ready)}
