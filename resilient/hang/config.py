"""`WatchdogConfig`: the public settings of hang detection, heartbeats, the monitored
barrier and the OOM guard's floor, with their checks and the environment override."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resilient.envvars import DEFAULT_HEARTBEAT_TIMEOUT_S, ENV_WATCHDOG, json_object_env
from resilient.errors import ConfigError
from resilient.hang.phases import Phase

__all__ = ["ENV_WATCHDOG", "WatchdogConfig"]

"""JSON object of WatchdogConfig fields that override the defaults (not values passed to
`resilient.init(watchdog=...)`), e.g. '{"timeout_s": 60}'; "0" or "off" disables the watchdog."""


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """Hang detection, heartbeats, the monitored barrier and the OOM guard's floor."""

    enabled: bool = True
    """Run heartbeats and the monitor. Off: no thread, no barrier, guards still agree."""
    heartbeat_interval_s: float = 1.0
    """Each rank publishes a heartbeat and checks for a verdict this often; it is also the
    monitor's period. While a timeout falls due the monitor looks closer (every 0.05 s), so
    a stall is named within about 0.05 s of its timeout."""
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    """No heartbeat for this long: the rank's process is dead or stopped."""
    timeout_s: float = 300.0
    """Progress timeout of the training phases (data, forward, backward, optimizer, step,
    agree): a live rank that stays this long in one of them is stalled. With
    `learn_timeouts`, the ceiling of their learned timeouts (the rule during the warm-up)."""
    startup_timeout_s: float = 900.0
    """Timeout of every phase until the first step of an attempt begins (process-group
    set-up, model build, checkpoint load)."""
    first_step_timeout_s: float | None = None
    """Timeout of the training phases inside the first step of an attempt (loader workers
    start, DDP's lazy imports, the first forward and all-reduce): a stall right after a
    resume is named after this long, not after `startup_timeout_s`. Default: `timeout_s` plus
    60 s for those one-time costs, at most `startup_timeout_s` (6 min with the defaults, not
    15). Raise it when the first step compiles (torch.compile) for longer than that."""
    worker_start_timeout_s: float = 15.0
    """A tracked loader's worker forked this long ago that has not started yet is stuck in its
    fork (a CPython bug before 3.10.15 / 3.11.10: data/worker_start.py); its rank is named
    then, not at the phase's timeout. Watched on affected interpreters only; a forked worker
    starts within milliseconds."""
    checkpoint_timeout_s: float = 1800.0
    """Timeout of the checkpoint, eval and finish phases."""
    phase_timeouts_s: dict[str, float] = field(default_factory=dict)
    """Per-phase overrides by name, e.g. {"eval": 3600}: pinned, never learned."""
    learn_timeouts: bool = True
    """Learn each training phase's timeout from the run (hang/learned.py): after
    `learn_warmup_steps` steps, max(`learn_floor_s`, `learn_factor` x the phase's
    `learn_quantile` duration), at most the fixed timeout (the ceiling). Checkpoint, eval,
    finish, start-up, the first step of an attempt and pinned phases keep the fixed values."""
    learn_warmup_steps: int = 20
    """Steps of an attempt on every rank before learned timeouts replace the fixed ones
    (a resumed run uses the checkpoint's learned values meanwhile, after its first step)."""
    learn_factor: float = 10.0
    """Learned timeout = this many times the phase's high-quantile duration (at least 2)."""
    learn_floor_s: float | None = None
    """No learned timeout below this; default 5 s, or `heartbeat_interval_s` when longer.
    Set below the heartbeat interval, a ConfigError."""
    heartbeat_learn_floor_s: float | None = None
    """With `learn_timeouts`: no learned heartbeat timeout below this; default 10 s, or three
    heartbeat intervals when longer (twice, at least). A monitor learns the
    heartbeat timeout of ranks in learned phases as max(this, `learn_factor` x the
    `learn_quantile` gap between their beats), at most `heartbeat_timeout_s`: a process that
    stops beating on another host is named in about 10 s, not 30. Raise it where a host may
    starve its ranks' heartbeat threads for longer (a GIL held by an extension, swapping)."""
    learn_quantile: float = 0.99
    """The quantile of a phase's recent durations (its last 512 progress intervals)."""
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
    straggler_scores_every_s: float | None = 10.0
    """Local rank 0 of each node logs every rank's straggler score (`straggler.scores`) this
    often: the live metrics and `resilient run --evict-stragglers` read it. None: never."""
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
        if self.first_step_timeout_s is None:
            self.first_step_timeout_s = min(self.startup_timeout_s, self.timeout_s + 60.0)
        if not self.timeout_s <= self.first_step_timeout_s <= self.startup_timeout_s:
            raise ConfigError(
                f"first_step_timeout_s ({self.first_step_timeout_s}) must lie between "
                f"timeout_s ({self.timeout_s}), what any later step gets, and "
                f"startup_timeout_s ({self.startup_timeout_s}), what the start-up before it "
                "gets"
            )
        if not self.worker_start_timeout_s > iv:
            raise ConfigError(
                f"worker_start_timeout_s ({self.worker_start_timeout_s}) must exceed "
                f"heartbeat_interval_s ({iv}), which is how often it is looked at"
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
        if self.learn_factor < 2:
            raise ConfigError(
                f"learn_factor ({self.learn_factor}) must be at least 2: a healthy phase "
                "twice its usual length would be named; raise it (default 10)"
            )
        if self.learn_floor_s is None:
            self.learn_floor_s = max(5.0, iv)
        if self.learn_floor_s < iv:
            raise ConfigError(
                f"learn_floor_s ({self.learn_floor_s}) must be at least heartbeat_interval_s "
                f"({iv}): a timeout shorter than a heartbeat cannot be judged; raise "
                "learn_floor_s (default 5) or lower heartbeat_interval_s"
            )
        if self.heartbeat_learn_floor_s is None:
            self.heartbeat_learn_floor_s = max(10.0, 3 * iv)
        if self.heartbeat_learn_floor_s < 2 * iv:
            raise ConfigError(
                f"heartbeat_learn_floor_s ({self.heartbeat_learn_floor_s}) must be at least "
                f"twice heartbeat_interval_s ({iv}): one late beat would read as a dead rank; "
                "raise heartbeat_learn_floor_s (default 10)"
            )
        if not 0.5 <= self.learn_quantile <= 1:
            raise ConfigError(f"learn_quantile must be in [0.5, 1], got {self.learn_quantile}")
        if self.learn_warmup_steps < 1:
            raise ConfigError(f"learn_warmup_steps must be >= 1, got {self.learn_warmup_steps}")
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
        if self.straggler_scores_every_s is not None and not self.straggler_scores_every_s > 0:
            raise ConfigError(
                "straggler_scores_every_s must be > 0 seconds or None, got "
                f"{self.straggler_scores_every_s}"
            )
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

    def pinned(self) -> frozenset[Phase]:
        """The phases `phase_timeouts_s` pins: never learned."""
        return frozenset(Phase.parse(n) for n in self.phase_timeouts_s)

    def first_step_timeouts(self) -> np.ndarray:
        """A timeout per Phase value inside the first step of an attempt: no phase gets less
        than after it, the training phases get at least `first_step_timeout_s`."""
        warm, _ = self.phase_timeouts()
        return np.maximum(warm, float(self.first_step_timeout_s or 0.0))
