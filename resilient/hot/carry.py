"""What a survivor of a hot recovery carries across the in-place re-run of its script.

This is the one process-wide singleton of the runtime, and it has to be: between the moment a
survivor's Runtime is taken down (`HotRecovery.restart`) and the moment the re-run script
builds its next Runtime (`restore.resume`), no object survives that both could be handed.
The user's script unwinds in between, with its model, optimizer and Runtime; only this
module's state, the process's imports and the launcher's store connection remain. So the
survivor keeps its snapshots here, the worker wrapper reads the generation to wait for and
the store connection from here, and the next Runtime takes it all out again, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resilient.storekeys import HotKeys


@dataclass
class Carry:
    """What a survivor keeps across the in-place re-run of its script."""

    generation: int
    """The generation it waits for."""
    keys: HotKeys
    wait_s: float
    """How long it waits for that generation before it goes cold."""
    steps: list[int]
    buffers: dict[int, dict[str, Any]]
    """Snapshot step -> this rank's state dict at that step (host memory)."""
    store: Any
    detected_at: float
    reason: str
    step: int
    """The step whose body was running when the loss was seen."""
    lost_save: int | None
    """The step of this rank's durable save that the loss interrupted (did not commit)."""
    sharded: bool
    """The state is sharded (FSDP2): a replacement needs its buddy's replica."""
    ward: int | None
    """The rank whose replica this rank holds (None: replicas=0)."""
    replica: dict[int, dict[str, Any]]
    """Snapshot step -> the ward's state dict at that step (localized; with DDP its
    per-rank part only)."""
    timings: dict[str, float] = field(default_factory=dict)
    interval: dict[str, Any] = field(default_factory=dict)
    """The adaptive snapshot interval and its measurements (Snapshots.interval_state)."""


_carry: Carry | None = None


def keep(carry: Carry) -> None:
    """A survivor's Runtime is down: keep what the next run of the script needs."""
    global _carry
    _carry = carry


def peek() -> Carry | None:
    """What is carried now, left in place (the wrapper waits with it)."""
    return _carry


def take() -> Carry | None:
    """Take what is carried out, once: the next Runtime restores from it."""
    global _carry
    carry, _carry = _carry, None
    return carry


def store() -> Any:
    """A survivor's connection to the launcher's store, for its re-run (None elsewhere): the
    re-run goes on with the connection it has, and never opens a server of its own."""
    return None if _carry is None else _carry.store


def note(name: str, seconds: float) -> None:
    """Add a timing of the survivor's way to the new generation (recovery.hot.formed)."""
    if _carry is not None:
        _carry.timings[name] = seconds
