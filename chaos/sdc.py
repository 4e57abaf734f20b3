"""Where the replica check of a DDP run must see a bit flipped in one replica (kind `bitflip`),
and which checkpoints it must then distrust.

With `numeric.sdc` on, the runtime compares the replicas' parameter fingerprints after the
step that brings its count to C when C is a multiple of `sdc_every` (runtime/loops.py,
`_close_step`), before every durable save (Runtime.save: the save steps, multiples of
`save_every` here, and the final save at `steps`). A flip inside step S (steps counted from
0, as the recipe prints them) changes the state after S + 1 steps: the first check that can
see it is the first of those at S + 1 or later; the last check that ran before it is the last
of those at S or earlier (the check at count S runs after step S - 1, before step S).

A save starts right after its own check passed, and an async save's staging copy still reads
the live tensors while the next step begins (its `step` and `data` phases come before the
fence in the model's forward pre-hook). So a save started after the last clean check before
the flip, the save of that check's own step, may hold the flip: the runtime names it in
`numeric.sdc`'s `suspect` (resilient/runtime/numeric.py) and never loads it after the
mismatch. Nothing here imports the harness, so the scenario module can use it.
"""

from __future__ import annotations

__all__ = ["check_steps", "first_check", "last_check"]


def check_steps(steps: int, save_every: int, sdc_every: int) -> list[int]:
    """Every step count at which a run of `steps` steps compares its replicas."""
    return [
        c for c in range(1, steps + 1) if c % sdc_every == 0 or c % save_every == 0 or c == steps
    ]


def first_check(at_step: int, steps: int, save_every: int, sdc_every: int) -> int:
    """The step count whose replica check sees a flip inside step `at_step`."""
    return next(c for c in check_steps(steps, save_every, sdc_every) if c > at_step)


def last_check(at_step: int, steps: int, save_every: int, sdc_every: int) -> int:
    """The step count of the last replica check before a flip inside step `at_step` (0: none
    came before it). A save of a step >= this one, started before the flip, is suspect."""
    return max((c for c in check_steps(steps, save_every, sdc_every) if c <= at_step), default=0)
