"""RetryPolicy: the one tenacity policy every storage call goes through.

Transient errors (resilient.storage.classify) are retried with exponential backoff and jitter
from a private RNG, within a per-call budget and an optional deadline (a save's budget);
permanent ones are raised at once. Knows nothing about torch or any storage system.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tenacity

from resilient.backoff import ExponentialJitter
from resilient.errors import ConfigError, StorageError
from resilient.log import get_logger
from resilient.storage.classify import is_retryable
from resilient.storage.redact import redact as _redact

__all__ = ["RetryPolicy"]

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How storage calls are retried. One instance is shared by every call of a Storage.

    An attempt is bounded by the transport's own timeouts (s3fs: connect 5 s, read 15 s;
    set `connect_timeout`/`read_timeout` in storage_options' config_kwargs to change them),
    so a call gives up within `budget_s` plus one attempt.
    """

    max_attempts: int = 8
    """Attempts per call, the first included."""
    budget_s: float = 120.0
    """Total seconds one call may spend retrying before it fails loudly."""
    save_budget_s: float | None = 600.0
    """Retry budget of one checkpoint save, in seconds from its start: once spent, a failing
    call is not retried any more and the save fails loudly; the previous checkpoint stays the
    newest valid one. A save that meets no error is never cut short. None: only the per-call
    limits apply."""
    initial_wait_s: float = 0.2
    """First backoff; doubles each attempt, plus up to `jitter_s` of random jitter, up to
    `max_wait_s`."""
    max_wait_s: float = 10.0
    """Largest single backoff."""
    jitter_s: float = 0.5
    """Random extra wait per retry, so ranks that failed together do not retry together."""
    sleep: Callable[[float], None] = field(default=tenacity.nap.sleep, repr=False)
    """Injected by tests to drive time without sleeping."""
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    """Time source of the save budget (tests drive it together with `sleep`)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.budget_s <= 0:
            raise ConfigError(f"RetryPolicy.budget_s must be > 0 seconds, got {self.budget_s}")
        if self.save_budget_s is not None and self.save_budget_s <= 0:
            raise ConfigError(
                f"RetryPolicy.save_budget_s must be > 0 seconds or None, got {self.save_budget_s}"
            )
        if not 0 < self.initial_wait_s <= self.max_wait_s:
            raise ConfigError(
                "RetryPolicy needs 0 < initial_wait_s <= max_wait_s, got "
                f"{self.initial_wait_s} and {self.max_wait_s}"
            )
        if self.jitter_s < 0:
            raise ConfigError(f"RetryPolicy.jitter_s must be >= 0, got {self.jitter_s}")

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        deadline: float | None = None,
        redact: Callable[[str], str] | None = None,
    ) -> T:
        """Run `fn` under the policy; `what` names the operation in events and errors.

        Retryable errors are retried until `max_attempts`, `budget_s` or `deadline` (a
        `clock()` time) would be passed; then StorageError says what failed, how often and
        why it stopped. Other errors are raised unchanged at once. Waits at most `budget_s`
        plus one attempt.
        """
        log = get_logger()
        scrub = redact or _redact
        start = self.clock()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "storage.retry",
                op=what,
                attempt=state.attempt_number,
                wait_s=round(state.upcoming_sleep, 3),
                error=scrub(f"{type(exc).__name__}: {exc}"),
            )

        stop = _Stop(self, start=start, deadline=deadline)
        retrying = tenacity.Retrying(
            stop=stop,
            wait=ExponentialJitter(
                initial_s=self.initial_wait_s, max_s=self.max_wait_s, jitter_s=self.jitter_s
            ),
            retry=tenacity.retry_if_exception(is_retryable),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as e:
            if not is_retryable(e):
                raise
            attempts = retrying.statistics.get("attempt_number", 1)
            elapsed = self.clock() - start
            raise StorageError(
                scrub(
                    f"{what} failed after {attempts} attempt(s) in {elapsed:.1f} s, {stop.reason}: "
                    f"{type(e).__name__}: {e}"
                )
            ) from e


class _Stop(tenacity.stop.stop_base):
    """Stop retrying when another attempt would pass a limit; `reason` says which.

    Uses the policy's clock (not tenacity's), so tests can drive all three limits.
    """

    def __init__(self, policy: RetryPolicy, *, start: float, deadline: float | None) -> None:
        self.policy = policy
        self.start = start
        self.deadline = deadline
        self.reason = ""

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        p = self.policy
        next_start = p.clock() + retry_state.upcoming_sleep
        if retry_state.attempt_number >= p.max_attempts:
            self.reason = f"max_attempts={p.max_attempts} reached"
        elif self.deadline is not None and next_start >= self.deadline:
            self.reason = "the save's time budget (RetryPolicy.save_budget_s) is spent"
        elif next_start - self.start >= p.budget_s:
            self.reason = f"the per-call budget of {p.budget_s:g} s (RetryPolicy.budget_s) is spent"
        else:
            return False
        return True
