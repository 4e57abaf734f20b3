"""Preemption inside the grace period: a signal becomes a stop at one step every rank agrees on.

The signal handler only records the time (no logging, no I/O: it runs between two bytecodes
of whatever the main thread was doing). At each step boundary the runtime asks `agree()`: one
all_reduce(MAX) of a one-element flag on the control group, so a signal seen by any rank
(the launcher forwards SIGTERM to all, Slurm signals all, `kill` may hit one) stops every rank
before the same step. They then finish an async save in flight, save the current step if the
budget allows (`budget()`: the slowest rank's estimate against the least time left), commit,
and leave with ExitCode.PREEMPTED by raising `Preempted` (a SystemExit) out of `steps()`.

The budget is `grace_s` from the signal, minus a margin for leaving the process groups and
exiting; the launcher (`resilient run`) waits that long before SIGKILL. When a save cannot
fit, none is started: the previous checkpoint stays the newest valid one.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from resilient.envvars import (
    DEFAULT_GRACE_S,
    DEFAULT_SIGNALS,
    ENV_GRACE_S,
    ENV_PREEMPT,
    ENV_PREEMPT_SIGNALS,
    json_object_env,
    parse_signals,
)
from resilient.errors import ConfigError
from resilient.exitcodes import ExitCode
from resilient.log import get_logger

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_SIGNALS",
    "ENV_GRACE_S",
    "ENV_PREEMPT",
    "ENV_PREEMPT_SIGNALS",
    "PreemptConfig",
    "Preempted",
    "PreemptionWatch",
    "parse_signals",
]


class Preempted(SystemExit):
    """Leaves the training loop after a coordinated stop; exits with ExitCode.PREEMPTED.

    A SystemExit, so the user's `except Exception` and the guard let it through and the
    process exits with the code a scheduler reads as "requeue me".
    """

    def __init__(self, *, step: int, committed: int | None) -> None:
        super().__init__(int(ExitCode.PREEMPTED))
        self.step = step
        self.committed = committed


@dataclass(kw_only=True, slots=True)
class PreemptConfig:
    """Which signals mean "save and leave", and how long there is to do it."""

    signals: tuple[str, ...] = DEFAULT_SIGNALS
    """Handled in the main thread from init() on; () to leave signals alone."""
    grace_s: float = DEFAULT_GRACE_S
    """Seconds from the signal to the SIGKILL that follows it (Kubernetes default: 30)."""
    exit_margin_s: float | None = None
    """Kept free at the end of the grace period for closing groups and exiting; default
    min(2 s, 10% of grace_s)."""
    check_every_steps: int | None = None
    """Agree on the flag every N steps (one tiny all_reduce each time). None: every
    `check_interval_s`, counted in steps from the slowest rank's step time, which the same
    all_reduce carries, so every rank derives the same N."""
    check_interval_s: float | None = None
    """With check_every_steps=None: about how often to agree; default min(1 s, 5% of
    grace_s). The stop comes up to this much after the signal, and the agreement's cost is
    spread over the steps in between."""

    def __post_init__(self) -> None:
        parse_signals(",".join(self.signals))
        if not self.grace_s > 0:
            raise ConfigError(f"preemption grace_s must be > 0 seconds, got {self.grace_s}")
        if self.exit_margin_s is None:
            self.exit_margin_s = min(2.0, 0.1 * self.grace_s)
        if not 0 <= self.exit_margin_s < self.grace_s:
            raise ConfigError(
                f"exit_margin_s ({self.exit_margin_s}) must be in [0, grace_s={self.grace_s})"
            )
        if self.check_every_steps is not None and self.check_every_steps < 1:
            raise ConfigError(
                f"check_every_steps must be >= 1 or None, got {self.check_every_steps}"
            )
        room = self.grace_s - self.exit_margin_s
        if self.check_interval_s is None:
            self.check_interval_s = min(1.0, 0.05 * self.grace_s)
        if not 0 < self.check_interval_s < room:
            raise ConfigError(
                f"check_interval_s ({self.check_interval_s}) must be > 0 and below the grace "
                f"period less its exit margin ({room:g} s): the stop may come that much late"
            )

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None) -> PreemptConfig:
        """Defaults, then $RESILIENT_PREEMPT, $RESILIENT_GRACE_S and $RESILIENT_PREEMPT_SIGNALS,
        then `overrides`. Raises ConfigError on unknown keys or bad values."""
        kw: dict[str, Any] = json_object_env(ENV_PREEMPT)
        raw = os.environ.get(ENV_GRACE_S, "").strip()
        if raw:
            try:
                kw["grace_s"] = float(raw)
            except ValueError as e:
                raise ConfigError(f"${ENV_GRACE_S}={raw!r} is not a number of seconds") from e
        sigs = os.environ.get(ENV_PREEMPT_SIGNALS)
        if sigs is not None:
            kw["signals"] = tuple(s.name for s in parse_signals(sigs))
        kw.update(overrides or {})
        known = set(cls.__dataclass_fields__)
        if set(kw) - known:
            raise ConfigError(
                f"unknown preempt option(s) {sorted(set(kw) - known)}; valid: {sorted(known)}"
            )
        if isinstance(kw.get("signals"), str):
            kw["signals"] = tuple(s.name for s in parse_signals(kw["signals"]))
        return cls(**kw)


class PreemptionWatch:
    """The preemption flag: set by a signal, agreed on by all ranks at step boundaries."""

    def __init__(
        self,
        config: PreemptConfig,
        *,
        group: Any,
        distributed: bool,
        leave_now: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        self._leave_now = leave_now
        """True when the rank is already failing: a signal then means "stop now" (the launcher
        is taking a broken group down), not "save" (which a broken group cannot do)."""
        self._group = group
        self._distributed = distributed
        self._previous: dict[signal.Signals, Any] = {}
        self.signal_at: float | None = None
        """time.monotonic() of the first signal this rank got (None: none)."""
        self.signal_name: str | None = None
        self.learned_at: float | None = None
        """When this rank learned of the stop (its own signal, or a peer's via agree())."""
        self.checks = 0
        self.check_s = 0.0
        """Number and total seconds of agree() calls (the steady-state cost)."""
        # [signal flag, seconds per step since the last agreement], reduced with MAX
        self._box = torch.zeros(2, dtype=torch.float64)
        self._since_check = 0
        self._last_check_t: float | None = None
        self.every = config.check_every_steps or 1
        """Steps between agreements now (identical on every rank)."""
        self.save_estimate_s: float | None = None
        """Duration of the last synchronous save on this rank: what a final save may take."""
        self._warned_slow_save = False

    # ------------------------------------------------------------------ signals
    def install(self) -> None:
        """Handle the configured signals (the Runtime does while steps() runs). Only from the
        main thread (a no-op elsewhere or when installed already)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in parse_signals(",".join(self.config.signals)):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # async-signal context: assignments only (logging here could re-enter a file write)
        if self._leave_now is not None and self._leave_now():
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(128 + signum)  # what the signal's default action would have done
        if self.signal_at is None:
            self.signal_at = time.monotonic()
            self.signal_name = signal.Signals(signum).name
            # The launcher signals this rank's whole process group (Slurm: every process), so
            # DataLoader workers die of it too, and the SIGCHLD handler the DataLoader set
            # would raise in the middle of the step instead of letting it reach the agreed
            # stop. The loader is not read again before the stop. SIGCHLD is numbered above
            # SIGTERM and SIGUSR1, and Python runs pending handlers in number order: this
            # runs first even when both are pending. (Ignoring the signal in the workers
            # instead hung the DataLoader's shutdown, which terminates them with SIGTERM.)
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    @property
    def requested(self) -> bool:
        return self.signal_at is not None

    # ------------------------------------------------------------------ agreement
    def agree(self, *, force: bool = False) -> bool:
        """True when any rank got a signal. A collective on the control group every
        `check_every_steps` calls (or when `force`); every rank must call it alike."""
        self._since_check += 1
        if not force and self._since_check < self.every:
            return False
        t0 = time.perf_counter()
        per_step = 0.0
        if self._last_check_t is not None:
            per_step = (t0 - self._last_check_t) / self._since_check
        self._since_check = 0
        self._box[0] = 1.0 if self.signal_at is not None else 0.0
        self._box[1] = per_step
        if self._distributed:
            dist.all_reduce(self._box, op=dist.ReduceOp.MAX, group=self._group)
        stop = bool(self._box[0] > 0)
        slowest = float(self._box[1])
        if self.config.check_every_steps is None and slowest > 0:
            # the same inputs on every rank, so the same N: the next agreement lines up
            interval = float(self.config.check_interval_s or 0.0)
            self.every = max(1, min(10_000, int(interval / slowest)))
        self.checks += 1
        self._last_check_t = time.perf_counter()
        self.check_s += self._last_check_t - t0
        if stop and self.learned_at is None:
            self.learned_at = time.monotonic()
        return stop

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds left for saving on this rank: grace minus time since the signal (or since
        this rank learned of the stop), minus the exit margin."""
        now = time.monotonic() if now is None else now
        start = self.signal_at if self.signal_at is not None else self.learned_at
        if start is None:
            return math.inf
        margin = float(self.config.exit_margin_s or 0.0)
        return self.config.grace_s - (now - start) - margin

    def budget(self, estimate_s: float | None) -> tuple[bool, float, float]:
        """Agree whether a save of about `estimate_s` seconds (None: unknown) fits.

        Returns (save, slowest estimate, least time left) identical on every rank. An unknown
        estimate counts as fitting: if it does not, SIGKILL leaves the save torn, and a torn
        save is never loaded.
        """
        est = -1.0 if estimate_s is None else float(estimate_s)
        box = torch.tensor([est, -self.remaining_s()], dtype=torch.float64)
        if self._distributed:
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._group)
        slowest, least = float(box[0]), -float(box[1])
        return (slowest < 0 or slowest <= least), slowest, least

    def note_save(self, seconds: float) -> None:
        """Record a synchronous save's duration; warn once if it would not fit the grace."""
        self.save_estimate_s = seconds
        room = self.config.grace_s - float(self.config.exit_margin_s or 0.0)
        if seconds > room and not self._warned_slow_save:
            self._warned_slow_save = True
            get_logger().warning(
                "preempt.grace_too_short",
                save_s=round(seconds, 3),
                grace_s=self.config.grace_s,
                note="a final save on preemption would not fit; the previous checkpoint "
                "would stay the newest valid. Raise the grace period or save less state",
            )

    def since_signal_s(self) -> float | None:
        start = self.signal_at if self.signal_at is not None else self.learned_at
        return None if start is None else round(time.monotonic() - start, 4)
