"""What a failed worker group leads to: restart at once, restart after a backoff, or stop.

Progress is the newest committed checkpoint step. A failure after progress restarts at once:
the run is healthy, something transient hit it. Consecutive failures without progress wait
longer and longer (exponential backoff with jitter from a private RNG: resilient/backoff.py),
and the failure that follows `crash_loop_restarts` such restarts ends the run as a crash
loop: restarting again would replay the same failure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from resilient.backoff import ExponentialJitter
from resilient.errors import ConfigError

__all__ = ["Decision", "RestartPolicy", "RestartTracker"]


@dataclass(kw_only=True, slots=True)
class RestartPolicy:
    """Backoff between restarts and the crash-loop limit."""

    backoff_s: float = 1.0
    """Wait before the first restart that follows a failure without checkpoint progress;
    doubled for each further one (a failure after progress restarts at once)."""
    backoff_max_s: float = 60.0
    """Ceiling of the wait, jitter included."""
    jitter_s: float = 1.0
    """Up to this many seconds added at random, so nodes do not rejoin in lock step."""
    crash_loop_restarts: int = 3
    """Stop with ExitCode.CRASH_LOOP when this many consecutive restarts made no checkpoint
    progress (the failure after the last of them ends the run)."""

    def __post_init__(self) -> None:
        if self.backoff_s < 0 or self.jitter_s < 0:
            raise ConfigError(
                f"restart backoff and jitter must be >= 0 seconds, got backoff {self.backoff_s}, "
                f"jitter {self.jitter_s}"
            )
        if self.backoff_max_s < self.backoff_s:
            raise ConfigError(
                f"restart backoff max ({self.backoff_max_s} s) must be >= the initial backoff "
                f"({self.backoff_s} s)"
            )
        if self.crash_loop_restarts < 1:
            raise ConfigError(
                f"crash-loop restarts must be >= 1 (restarts without progress before giving "
                f"up), got {self.crash_loop_restarts}"
            )

    def delay(self, streak: int) -> float:
        """Seconds to wait before restart number `streak` of a run without progress (>= 1)."""
        if streak < 1 or (self.backoff_s == 0 and self.jitter_s == 0):
            return 0.0
        return ExponentialJitter(
            initial_s=self.backoff_s, max_s=self.backoff_max_s, jitter_s=self.jitter_s
        ).delay(streak)


@dataclass(frozen=True, slots=True)
class Decision:
    """The tracker's answer to one failure."""

    restart: bool
    delay_s: float
    streak: int
    """Consecutive failed attempts without checkpoint progress, this one included."""
    progress: int | None
    """The newest committed step now (None: none yet, or unknown)."""
    previous: int | None
    """The newest committed step at the previous failure (or at launch)."""


class RestartTracker:
    """Counts consecutive failures without checkpoint progress.

    `probe()` returns the newest committed checkpoint step (None when there is none); it is
    read at construction (the baseline) and at every failure.
    """

    def __init__(self, policy: RestartPolicy, probe: Callable[[], int | None]) -> None:
        self.policy = policy
        self._probe = probe
        self._last = probe()
        self.streak = 0

    def on_failure(self, *, restarts_left: int) -> Decision:
        """Record a failed attempt and decide: restart (after `delay_s`) or stop."""
        now = self._probe()
        previous = self._last
        progressed = now is not None and (previous is None or now > previous)
        self.streak = 0 if progressed else self.streak + 1
        self._last = now if now is not None else previous
        if self.streak > self.policy.crash_loop_restarts or restarts_left <= 0:
            return Decision(
                restart=False, delay_s=0.0, streak=self.streak, progress=now, previous=previous
            )
        return Decision(
            restart=True,
            delay_s=self.policy.delay(self.streak),
            streak=self.streak,
            progress=now,
            previous=previous,
        )

    @property
    def crash_loop(self) -> bool:
        return self.streak > self.policy.crash_loop_restarts
