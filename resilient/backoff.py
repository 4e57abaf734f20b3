"""Exponential backoff with jitter from a private RNG: the one wait policy for every retry.

tenacity's own jitter (`wait_exponential_jitter`, `wait_random`) draws from the global `random`
module, whose state a training run checkpoints and restores with its other RNG states: a retry
or a restart would then change what a resumed run draws, and exact resume would be lost. This
wait draws from a `random.Random` of its own instead.

It is a tenacity wait, so it goes straight into `tenacity.Retrying(wait=...)`; `delay(n)` gives
the same number for code that waits without tenacity's loop (the supervisor's restarts).
"""

from __future__ import annotations

import random

import tenacity

from resilient.errors import ConfigError

__all__ = ["ExponentialJitter"]

_RNG = random.Random()  # seeded from the OS, never from the training seed


class ExponentialJitter(tenacity.wait.wait_base):
    """Before retry `n` (1, 2, ...): min(max_s, initial_s * 2**(n - 1) + U(0, jitter_s)) s.

    The jitter is drawn from `rng` (a private generator by default), so processes that failed
    together do not retry together, and the global RNG is never touched.
    """

    def __init__(
        self,
        *,
        initial_s: float,
        max_s: float,
        jitter_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if initial_s < 0 or jitter_s < 0 or max_s < initial_s:
            raise ConfigError(
                "backoff needs 0 <= initial_s <= max_s and jitter_s >= 0, got initial_s "
                f"{initial_s}, max_s {max_s}, jitter_s {jitter_s}"
            )
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter_s = jitter_s
        self.rng = rng or _RNG

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (>= 1)."""
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        jitter = self.rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0
        try:
            exp = self.initial_s * 2 ** (attempt - 1)
        except OverflowError:
            return self.max_s
        return min(self.max_s, exp + jitter)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)
