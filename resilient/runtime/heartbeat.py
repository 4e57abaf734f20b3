"""Heartbeats and the hang detector: what each rank publishes, and the logic that judges it.

Pure logic: no thread, no store, no torch.distributed (the watchdog in watchdog.py runs it).

Two signals, two failure modes:
- liveness: a daemon thread bumps the beat counter every `heartbeat_interval_s`, also while the
  main thread is blocked in C++ (a gloo collective releases the GIL). No new beat for
  `heartbeat_timeout_s` means the process is dead or stopped (SIGSTOP).
- progress: the main thread moves through phases (data, forward, backward, optimizer, ...).
  The culprits of a stall are the live ranks furthest behind (lowest progress sequence
  number: in a DDP hang the sleeper is still in `forward` while its peers wait in
  `backward`); they are named once their progress is older than their own phase's timeout.

Ages are measured by each rank on its own monotonic clock and aged further by the monitor's
clock from when it saw the beat, so clocks never need to agree across hosts. Detection
latency is at most the timeout plus one heartbeat interval.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import signal
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resilient.envvars import ENV_WATCHDOG, json_object_env
from resilient.errors import ConfigError

__all__ = [
    "BEAT_DTYPE",
    "ENV_WATCHDOG",
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
]


class Phase(enum.IntEnum):
    """Where a rank's main thread is. Phases change at most a few times per micro-batch."""

    STARTUP = 0
    """From `resilient.init()` to the first step (process group, model build, resume)."""
    STEP = 1
    """Inside a step, in user code that no other phase covers."""
    DATA = 2
    FORWARD = 3
    BACKWARD = 4
    """Entered when the forward returns: loss, backward and the gradient all-reduce."""
    OPTIMIZER = 5
    AGREE = 6
    """Control-group collectives: guard agreement, monitored barrier, save decisions."""
    CHECKPOINT = 7
    EVAL = 8
    FINISH = 9
    """After `steps()` ended: final digests, evaluation, `close()`."""
    CLOSED = 10
    """Left normally; no heartbeat is expected any more."""

    @classmethod
    def parse(cls, name: str | Phase) -> Phase:
        if isinstance(name, Phase):
            return name
        try:
            return cls[name.upper()]
        except KeyError:
            known = ", ".join(p.name.lower() for p in cls if p is not cls.CLOSED)
            raise ConfigError(f"unknown phase {name!r}; known phases: {known}") from None


# Phases that hold no DDP collective: their time per step tells a straggler from its peers
# (everyone's step time is the same once the all-reduce waits for the slowest rank).
_LOCAL_PHASES = frozenset({Phase.DATA, Phase.FORWARD, Phase.OPTIMIZER})

FLAG_WARM = 1
"""The rank completed its first step in this attempt: the tight timeouts apply."""
FLAG_OOM = 2
FLAG_FAILED = 4
"""The rank's guard caught an exception (FLAG_OOM too for an out-of-memory error)."""


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """Hang detection, heartbeats, the monitored barrier and the OOM guard's floor."""

    enabled: bool = True
    """Run heartbeats and the monitor. Off: no thread, no barrier, guards still agree."""
    heartbeat_interval_s: float = 1.0
    """Each rank publishes a heartbeat and checks for a verdict this often; it is also the
    monitor's period, so detection takes at most the timeout plus this long."""
    heartbeat_timeout_s: float = 30.0
    """No heartbeat for this long: the rank's process is dead or stopped."""
    timeout_s: float = 300.0
    """Progress timeout of the training phases (data, forward, backward, optimizer, step,
    agree): a live rank that stays this long in one of them is stalled."""
    startup_timeout_s: float = 900.0
    """Timeout of every phase until the first step of an attempt completes (process-group
    set-up, model build, checkpoint load, the first forward); tightened after it."""
    checkpoint_timeout_s: float = 1800.0
    """Timeout of the checkpoint, eval and finish phases."""
    phase_timeouts_s: dict[str, float] = field(default_factory=dict)
    """Per-phase overrides by name, e.g. {"eval": 3600}."""
    barrier_every_steps: int | None = 100
    """A monitored barrier on the control group every N steps names a rank that never
    arrives; None to skip it."""
    barrier_timeout_s: float | None = None
    """How long the barrier waits; default timeout_s + heartbeat_timeout_s (it must exceed
    both, so the heartbeat monitor, which knows the phase, speaks first)."""
    straggler_factor: float | None = 2.0
    """Flag a rank whose time per step in local phases (data, forward, optimizer) stays above
    this multiple of the median; None to turn straggler reports off."""
    straggler_patience: int = 5
    """...for this many consecutive monitor periods in which steps advanced."""
    dump_stacks: bool = True
    """A stalled rank writes its Python stacks to <run_dir>/stacks/rank<R>.txt before exiting."""
    dump_signal: str | None = "SIGUSR2"
    """Also dump stacks on this signal (faulthandler: works while stuck in C++); None: no."""
    kill_stopped: bool = True
    """Kill a stopped (SIGSTOP) rank on the same host once named: it cannot exit by itself and
    would hold the launcher's shutdown for its full kill timeout."""
    exit_grace_s: float | None = None
    """On a verdict, how long a rank waits for every live rank to acknowledge it before
    exiting (so nobody dies of a closed connection first); default 2 intervals + 1 s."""
    min_micro_batch_size: int = 1
    """The OOM guard halves the micro-batch down to this many samples, then restarts."""

    def __post_init__(self) -> None:
        iv = self.heartbeat_interval_s
        if not 0 < iv <= 60:
            raise ConfigError(f"heartbeat_interval_s must be in (0, 60] seconds, got {iv}")
        if self.heartbeat_timeout_s < 2 * iv:
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice "
                f"heartbeat_interval_s ({iv}): one late beat would read as a dead rank"
            )
        if self.timeout_s <= iv:
            raise ConfigError(
                f"timeout_s ({self.timeout_s}) must exceed heartbeat_interval_s ({iv}); "
                "raise timeout_s or publish heartbeats more often"
            )
        if self.startup_timeout_s < self.timeout_s:
            raise ConfigError(
                f"startup_timeout_s ({self.startup_timeout_s}) must be >= timeout_s "
                f"({self.timeout_s}): the first step also builds buckets, spawns loader "
                "workers and loads the checkpoint"
            )
        if self.checkpoint_timeout_s <= iv:
            raise ConfigError(f"checkpoint_timeout_s must exceed heartbeat_interval_s ({iv})")
        for name, value in self.phase_timeouts_s.items():
            phase = Phase.parse(name)
            if phase in (Phase.CLOSED,) or not value > iv:
                raise ConfigError(
                    f"phase_timeouts_s[{name!r}] = {value}: must be a phase other than closed "
                    f"with a timeout above heartbeat_interval_s ({iv})"
                )
        if self.barrier_timeout_s is None:
            self.barrier_timeout_s = self.timeout_s + self.heartbeat_timeout_s
        if self.barrier_timeout_s <= max(self.timeout_s, self.heartbeat_timeout_s):
            raise ConfigError(
                f"barrier_timeout_s ({self.barrier_timeout_s}) must exceed timeout_s "
                f"({self.timeout_s}) and heartbeat_timeout_s ({self.heartbeat_timeout_s}): "
                "heartbeat interval < timeouts < barrier timeout"
            )
        if self.barrier_every_steps is not None and self.barrier_every_steps < 1:
            raise ConfigError(
                f"barrier_every_steps must be >= 1 or None, got {self.barrier_every_steps}"
            )
        if self.straggler_factor is not None and not self.straggler_factor > 1:
            raise ConfigError(f"straggler_factor must be > 1 or None, got {self.straggler_factor}")
        if self.straggler_patience < 1:
            raise ConfigError(f"straggler_patience must be >= 1, got {self.straggler_patience}")
        if self.dump_signal is not None and not isinstance(
            getattr(signal, self.dump_signal, None), signal.Signals
        ):
            raise ConfigError(f"dump_signal {self.dump_signal!r} is not a signal name (SIGUSR2)")
        if self.exit_grace_s is None:
            self.exit_grace_s = 2 * iv + 1.0
        if self.exit_grace_s < 0:
            raise ConfigError(f"exit_grace_s must be >= 0, got {self.exit_grace_s}")
        if self.min_micro_batch_size < 1:
            raise ConfigError(f"min_micro_batch_size must be >= 1, got {self.min_micro_batch_size}")

    @classmethod
    def from_env(cls, overrides: Mapping[str, Any] | None = None) -> WatchdogConfig:
        """Defaults, then $RESILIENT_WATCHDOG, then `overrides`. ConfigError on unknown keys."""
        fields: dict[str, Any] = {}
        raw = os.environ.get(ENV_WATCHDOG, "").strip()
        if raw.lower() in {"0", "off", "false", "no"}:
            fields["enabled"] = False
        else:
            fields.update(json_object_env(ENV_WATCHDOG))
        fields.update(overrides or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise ConfigError(
                f"unknown watchdog option(s) {sorted(unknown)}; valid: {sorted(known)}"
            )
        return cls(**fields)

    def phase_timeouts(self) -> tuple[np.ndarray, np.ndarray]:
        """(after the first step, before it): a timeout per Phase value; CLOSED never times out."""
        warm = np.full(len(Phase), self.timeout_s, dtype=np.float64)
        for p in (Phase.CHECKPOINT, Phase.EVAL, Phase.FINISH):
            warm[p] = self.checkpoint_timeout_s
        warm[Phase.STARTUP] = self.startup_timeout_s
        for name, value in self.phase_timeouts_s.items():
            warm[Phase.parse(name)] = value
        warm[Phase.CLOSED] = math.inf
        cold = np.maximum(warm, self.startup_timeout_s)
        return warm, cold


class Progress:
    """The main thread's position, read by the heartbeat thread. Updates are a few attribute
    stores (atomic under the GIL), cheap enough for every phase change."""

    __slots__ = (
        "_x",
        "flags",
        "local_ema",
        "local_s",
        "phase",
        "seq",
        "since",
        "step",
        "steps_done",
    )

    def __init__(self) -> None:
        self.phase = Phase.STARTUP
        self.step = -1
        self.seq = 0
        self.since = time.monotonic()
        self.flags = 0
        self.local_s = 0.0
        self.local_ema = 0.0
        self.steps_done = 0

    def enter(self, phase: Phase) -> None:
        """Move to `phase` (counts as progress even when it is the current one)."""
        self._set(phase)

    def resume(self, phase: Phase) -> None:
        """Return to `phase` after a nested one (progress, but not a new entry into it)."""
        self._set(phase)

    def _set(self, phase: Phase) -> None:
        now = time.monotonic()
        if self.phase in _LOCAL_PHASES:
            self.local_s += now - self.since
        self.phase = phase
        self.since = now
        self.seq += 1

    def tick(self) -> None:
        """Progress inside the current phase (a sharded block's forward, the first gradient)."""
        now = time.monotonic()
        if self.phase in _LOCAL_PHASES:
            self.local_s += now - self.since
        self.since = now
        self.seq += 1

    def begin_step(self, step: int) -> None:
        self.step = step
        self.local_s = 0.0
        self.enter(Phase.STEP)

    def end_step(self) -> None:
        self.tick()  # close the open local interval
        first = not self.flags & FLAG_WARM
        self.local_ema = self.local_s if first else 0.5 * self.local_ema + 0.5 * self.local_s
        self.flags |= FLAG_WARM
        self.steps_done += 1


_BEAT = struct.Struct("<IIqBBff")
BEAT_DTYPE = np.dtype(
    [
        ("beat", "<u4"),
        ("seq", "<u4"),
        ("step", "<i8"),
        ("phase", "u1"),
        ("flags", "u1"),
        ("age", "<f4"),
        ("local", "<f4"),
    ]
)
assert BEAT_DTYPE.itemsize == _BEAT.size


def encode_beat(beat: int, progress: Progress, now: float | None = None) -> bytes:
    """26 bytes: beat counter, progress seq, step, phase, flags, progress age, local s/step."""
    now = time.monotonic() if now is None else now
    return _BEAT.pack(
        beat & 0xFFFFFFFF,
        progress.seq & 0xFFFFFFFF,
        progress.step,
        int(progress.phase),
        progress.flags,
        max(0.0, now - progress.since),
        progress.local_ema,
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

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("progress_age_s", "silent_s", "timeout_s"):
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
        self._strag_count = np.zeros(n, dtype=np.int64)
        self._strag_flagged = np.zeros(n, dtype=bool)
        self._strag_step = -1

    def update(self, payloads: Sequence[bytes] | bytes, now: float | None = None) -> Report:
        """Fold in one round of heartbeats (in `watch` order) and judge them."""
        beats = decode_beats(payloads)
        if len(beats) != len(self.ranks):
            raise ValueError(f"{len(beats)} heartbeats for {len(self.ranks)} watched ranks")
        now = self._clock() if now is None else now
        fresh = beats["beat"] != self._beat
        self._beat = beats["beat"].copy()
        self._seen[fresh] = now
        self._age[fresh] = beats["age"][fresh]
        silent = now - self._seen
        phase = np.minimum(beats["phase"], int(Phase.CLOSED))
        active = phase != Phase.CLOSED
        dead = active & (silent > self.config.heartbeat_timeout_s)
        flags = beats["flags"]
        warm = (flags & FLAG_WARM) != 0
        limit = np.where(warm, self._warm_t[phase], self._cold_t[phase])
        progress_age = self._age + silent
        if dead.any():
            named, kind = dead, "no_heartbeat"
            blocked = np.zeros_like(dead)
        elif self.liveness_only:
            return Report(None)
        else:
            # a beat overdue by two periods: the rank is probably stopped or dead; its stale
            # progress says nothing, so wait for its beat or for the heartbeat timeout
            quiet = active & (silent > 2 * self.config.heartbeat_interval_s)
            over = active & ~quiet & (progress_age > limit)
            if not over.any():
                return Report(None, self._stragglers(beats, active & warm))
            if quiet.any():
                return Report(None)
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
                    return Report(None)
            blocked = over & ~named

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
