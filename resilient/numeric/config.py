"""`NumericConfig`: what counts as a numerical fault, and what the run does about one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from resilient.envvars import ENV_NUMERIC, json_object_env
from resilient.errors import ConfigError

__all__ = ["POLICIES", "NumericConfig"]

POLICIES = ("stop", "skip")


@dataclass(kw_only=True, slots=True)
class NumericConfig:
    """Numerical-fault detection and response (resilient/numeric/).

    A fault is seen on some rank and agreed by all: a non-finite gradient (checked before
    `optimizer.step()` changes anything), a non-finite loss given to `rt.observe(loss=...)`,
    or, when `spike_factor` is set, an observed loss above `spike_factor` times its running
    mean. The step that saw it changes no weights. The first time at a step the run rolls
    back (to the newest in-memory snapshot, or cold to the newest checkpoint) and replays;
    the same step failing again is persistent: `policy` says what then.
    """

    nonfinite: bool = True
    """Check gradients and the observed loss for NaN and inf (on by default)."""
    spike_factor: float | None = None
    """A loss above this multiple of its running mean is a fault (off: None). Needs
    `rt.observe(loss=...)`."""
    spike_window: int = 50
    """Steps the running mean of the loss spans (an exponential mean of that span); no
    spike is judged before this many steps have been observed."""
    policy: str = "stop"
    """For a persistent fault (the same step fails again on the same inputs): "stop" ends
    the run with ExitCode.NUMERICAL_FAULT, every good checkpoint kept; "skip" skips the
    step's update (its batch is consumed, no weight changes) and goes on, at most
    `max_skips` times."""
    max_skips: int = 10
    """Steps "skip" may skip in a run; one more stops it."""
    sdc: bool = False
    """DDP, HSDP: check that every replica (HSDP: within each replicate group) holds
    bit-identical parameters before each durable save and every `sdc_every` steps (silent
    data corruption: numeric/replicas.py). A mismatch restarts from the newest checkpoint,
    which was checked at its save."""
    sdc_every: int = 100
    """Steps between replica checks beside the saves' own."""
    rerun: bool = False
    """Run every `rerun_every`-th step twice, from the snapshot before it and on the same
    inputs, and compare the parameters and optimizer state after each run bitwise on every
    rank (silent data corruption where there is no replica to compare with: FSDP2). Needs
    snapshots and `rt.steps()`. Exact on CPU and with deterministic GPU kernels only."""
    rerun_every: int = 200
    """Steps between sampled re-runs (the cost is about one step in `rerun_every`)."""
    skip_steps: tuple[int, ...] = ()
    """Steps whose update is skipped from the start: to reproduce a run that skipped them
    (its report lists them), or to skip batches known to be bad."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f"numeric policy must be one of {list(POLICIES)}, got {self.policy!r}"
            )
        if self.spike_factor is not None and self.spike_factor <= 1:
            raise ConfigError(
                f"numeric spike_factor must be > 1 (a multiple of the running mean loss) or "
                f"None, got {self.spike_factor}"
            )
        if self.spike_window < 1:
            raise ConfigError(f"numeric spike_window must be >= 1 steps, got {self.spike_window}")
        if self.rerun_every < 1:
            raise ConfigError(f"numeric rerun_every must be >= 1 steps, got {self.rerun_every}")
        if self.sdc_every < 1:
            raise ConfigError(f"numeric sdc_every must be >= 1 steps, got {self.sdc_every}")
        if self.max_skips < 0:
            raise ConfigError(f"numeric max_skips must be >= 0, got {self.max_skips}")
        self.skip_steps = tuple(int(s) for s in self.skip_steps)
        if any(s < 0 for s in self.skip_steps):
            raise ConfigError(f"numeric skip_steps must be >= 0, got {list(self.skip_steps)}")

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None) -> NumericConfig:
        """Defaults, then $RESILIENT_NUMERIC (a JSON object), then `overrides`."""
        return cls.from_dict({**json_object_env(ENV_NUMERIC), **(overrides or {})})

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> NumericConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(fields) - known:
            raise ConfigError(
                f"unknown numeric option(s) {sorted(set(fields) - known)}; valid: {sorted(known)}"
            )
        return cls(**fields)
