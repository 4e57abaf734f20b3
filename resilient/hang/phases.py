"""Where a rank's main thread is: the phases, the heartbeat flags and `Progress`.

`Progress` is written by the main thread (a few attribute stores per phase change) and read
by the watchdog's heartbeat thread; no lock (each store is atomic under the GIL).
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

from resilient import faultpoints
from resilient.errors import ConfigError

__all__ = [
    "FLAG_FAILED",
    "FLAG_HELD",
    "FLAG_MICRO_BACKWARD",
    "FLAG_ONE_OFF",
    "FLAG_OOM",
    "FLAG_WARM",
    "LEARNED_PHASES",
    "LOCAL_PHASES",
    "Phase",
    "Progress",
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
LOCAL_PHASES = frozenset({Phase.DATA, Phase.FORWARD, Phase.OPTIMIZER})
# Phases whose timeouts are learned from the run (hang/learned.py); the others (start-up,
# checkpoint, eval, finish) are legitimately long now and then and keep the fixed ones.
LEARNED_PHASES = (
    Phase.STEP,
    Phase.DATA,
    Phase.FORWARD,
    Phase.BACKWARD,
    Phase.OPTIMIZER,
    Phase.AGREE,
)

FLAG_WARM = 1
"""The rank completed its first step in this attempt: the tight timeouts apply."""
FLAG_OOM = 2
FLAG_FAILED = 4
"""The rank's guard caught an exception (FLAG_OOM too for an out-of-memory error)."""
FLAG_MICRO_BACKWARD = 8
"""A pipeline stage's micro-batch (`Progress.micro`) is in its backward: its gradient has
reached the stage's output. Without it, the micro-batch's forward (or what follows it: the
send of its activations, the wait for the next one)."""
FLAG_ONE_OFF = 16
"""The current phase's interval is a one-off (an epoch's first batch spawns loader workers):
it keeps the fixed timeout and stays out of the learned statistics until the next phase."""
FLAG_HELD = 32
"""Inside a block of a phase whose timeout is not learned (`rt.phase("eval")`, a save): the
phases its code passes through (an evaluation's forwards through the tracked model enter
forward) keep the fixed timeouts and stay out of the learned statistics."""


_UNLEARNED = FLAG_WARM | FLAG_ONE_OFF | FLAG_HELD
"""Flags of which only FLAG_WARM may be set for an interval to count in the statistics."""


class Intervals(Protocol):
    """Where a warm rank's progress intervals go (hang/learned.py's PhaseStats)."""

    def add(self, phase: int, seconds: float) -> None: ...


class Progress:
    """The main thread's position, read by the heartbeat thread. Updates are a few attribute
    stores (atomic under the GIL), cheap enough for every phase change."""

    __slots__ = (
        "_x",
        "flags",
        "local_ema",
        "local_s",
        "micro",
        "phase",
        "seq",
        "since",
        "stage",
        "stats",
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
        self.stage = -1
        """A pipeline stage's index (-1: not pipelined)."""
        self.micro = -1
        """A pipeline stage's micro-batch in this step: the forward or backward of it that
        the phase names (-1: none yet, or not pipelined)."""
        self.stats: Intervals | None = None
        """Where warm progress intervals are recorded for learned timeouts (None: not)."""

    def enter(self, phase: Phase) -> None:
        """Move to `phase` (counts as progress even when it is the current one)."""
        self._set(phase)
        faultpoints.hit(faultpoints.PHASE_ENTER, step=self.step, phase=phase)

    def resume(self, phase: Phase) -> None:
        """Return to `phase` after a nested one (progress, but not a new entry into it)."""
        self._set(phase)

    def _set(self, phase: Phase) -> None:
        self.tick()
        self.phase = phase
        self.flags &= ~FLAG_ONE_OFF

    def tick(self) -> None:
        """Progress inside the current phase (a sharded block's forward, the first gradient)."""
        now = time.monotonic()
        spent = now - self.since
        if self.phase in LOCAL_PHASES:
            self.local_s += spent
        if self.stats is not None and self.flags & _UNLEARNED == FLAG_WARM:
            self.stats.add(self.phase, spent)
        self.since = now
        self.seq += 1

    def hold(self, phase: Phase) -> bool:
        """Inside a block of `phase` (Watchdog.phase): hold FLAG_HELD when its timeout is not
        learned. Returns whether it was held already, for `release`."""
        held = bool(self.flags & FLAG_HELD)
        if phase not in LEARNED_PHASES:
            self.flags |= FLAG_HELD
        return held

    def release(self, held: bool) -> None:
        """Leaving the block: FLAG_HELD as it was before `hold`."""
        if not held:
            self.flags &= ~FLAG_HELD

    def one_off(self) -> None:
        """The interval in the current phase, from now to its next progress, is a one-off:
        the fixed timeout holds for it (FLAG_ONE_OFF)."""
        self.flags |= FLAG_ONE_OFF

    def micro_batch(self, k: int, *, backward: bool) -> None:
        """A pipeline stage's micro-batch `k` enters its forward or its backward."""
        self.micro = k
        self.flags = (
            (self.flags | FLAG_MICRO_BACKWARD) if backward else (self.flags & ~FLAG_MICRO_BACKWARD)
        )
        if backward:
            self.enter(Phase.BACKWARD)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.local_s = 0.0
        self.micro = -1
        self.flags &= ~FLAG_MICRO_BACKWARD
        self.enter(Phase.STEP)

    def end_step(self) -> None:
        self.tick()  # close the open local interval
        first = not self.flags & FLAG_WARM
        self.local_ema = self.local_s if first else 0.5 * self.local_ema + 0.5 * self.local_s
        self.flags |= FLAG_WARM
        self.steps_done += 1
