"""Seeded fault schedules: the soak's random scenarios and `repeat`'s runs of one kind.

Split from chaos/scenario.py (what a scenario is); these only draw them, reproducibly from a
seed, so that a seed's schedules stay what they were as new kinds are added.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from chaos.scenario import (
    _IN_STEP,
    _PHASES,
    _SPIKE_FACTOR,
    FAULT_KINDS,
    HOT_KINDS,
    HOT_ONLY,
    LOST_PROCESS,
    NUMERIC,
    POISON,
    S3_ONLY,
    SDC,
    SDC_PHASES,
    TWO_HOSTS,
    Fault,
    Scenario,
)

__all__ = ["generate", "numeric_defaults", "repeated"]


def generate(
    seed: int,
    count: int,
    *,
    steps: int = 24,
    save_every: int = 4,
    max_faults: int = 2,
    hot_fraction: float = 0.0,
    hot_lost: bool = False,
    numeric_fraction: float = 0.0,
    mesh_fraction: float = 0.0,
) -> list[Scenario]:
    """`count` random scenarios from `seed`: fault kinds, ranks and steps drawn reproducibly.

    A `hot_fraction` of them, drawn from a generator of their own (so the cold schedules of
    a seed stay what they were), run in hot mode with HOT_KINDS; the lost-process kinds only
    with `hot_lost` (where `resilient run --hot-recovery` exists). A `numeric_fraction` of
    them, from a third generator, have one numerical fault instead (NUMERIC; hot mode for a
    `hot_fraction` of those): every other index keeps the schedule it had without them. A
    `_BITFLIP_SHARE` of those, from a fourth, are a bitflip (added later: the other numerical
    draws keep theirs). A `mesh_fraction`, from a fifth, run recipes/train_nd.py on a drawn
    4-rank mesh instead (`_draw_mesh`)."""
    rng = random.Random(seed)
    hot_rng = random.Random(f"hot-{seed}")
    numeric_rng = random.Random(f"numeric-{seed}")
    sdc_rng = random.Random(f"sdc-{seed}")
    mesh_rng = random.Random(f"mesh-{seed}")
    out = []
    for i in range(count):
        sc = _draw_cold(rng, seed, i, steps, save_every, max_faults)
        if hot_rng.random() < hot_fraction:
            sc = _draw_hot(hot_rng, sc.name, steps, save_every, max_faults, hot_lost)
        if numeric_rng.random() < numeric_fraction:
            sc = _draw_numeric(numeric_rng, sc.name, steps, save_every, hot_fraction)
            if sdc_rng.random() < _BITFLIP_SHARE:
                sc = _draw_bitflip(sdc_rng, sc.name, steps, save_every, hot_fraction)
        if mesh_rng.random() < mesh_fraction:
            sc = _draw_mesh(mesh_rng, sc.name, save_every, hot_fraction, hot_lost)
        out.append(sc)
    return out


_SPIKE_SEEN = {"spike_factor": 5.0, "spike_window": 3}
"""Spike detection for a drawn spike: a loss above 5 times its running mean over 3 steps
(the injected one is about 1000 times it; the toy's own loss only falls)."""


_SDC_SEEN = {"sdc": True, "sdc_every": 3}
"""The replica check for a drawn bitflip: every 3 steps, besides the one before each save
(every 4): a flip is seen 1-3 steps later, by a save's check or by the interval's."""
_BITFLIP_SHARE = 0.3
"""The share of the soak's numerical draws that are a bitflip."""


def numeric_defaults(kind: str) -> dict[str, Any]:
    """The numeric settings a fault of `kind` needs to be seen: spike detection for a spike,
    the replica check for a bitflip."""
    if kind == "bitflip":
        return dict(_SDC_SEEN)
    return dict(_SPIKE_SEEN) if kind == "spike" else {}


def _draw_numeric(
    rng: random.Random, name: str, steps: int, save_every: int, hot_fraction: float
) -> Scenario:
    """One numerical fault: a NaN or a spike once (transient), or a bad batch (persistent,
    under policy skip or stop, NaN or a spike), on either recipe, hot (snapshots on, rolled
    back in place) or cold (restarted from the newest checkpoint)."""
    kind = rng.choice(sorted(POISON))  # a bitflip has a draw of its own (generate)
    hot = rng.random() < hot_fraction
    recipe = rng.choice(["train_ddp.py", "train_fsdp.py"])
    at_step = rng.randrange(save_every + 1, steps - save_every)
    rank = rng.randint(0, 1)
    numeric = numeric_defaults(kind)
    factor = None
    if kind == "bad_batch":
        numeric["policy"] = rng.choice(["skip", "stop"])
        if rng.random() < 0.5:  # a batch whose loss spikes, every time
            factor = _SPIKE_FACTOR
            numeric.update(_SPIKE_SEEN)
    fault = Fault(kind=kind, rank=rank, at_step=at_step, phase="forward", factor=factor)
    return Scenario(
        name=name,
        recipe=recipe,
        steps=steps,
        save_every=save_every,
        hot=hot,
        numeric=numeric,
        faults=[fault],
    )


def _draw_bitflip(
    rng: random.Random, name: str, steps: int, save_every: int, hot_fraction: float
) -> Scenario:
    """One bitflip on DDP: 2 ranks (no majority: the replay decides) or 3 (the majority
    names the rank), any rank, any phase (`step` and `data` too: before the step's save
    fence, where an async save's copy may take the flip), hot or cold (either way restarted
    from a checkpoint a clean check proved: a snapshot may hold the flip)."""
    nproc = rng.choice([2, 3])
    fault = Fault(
        kind="bitflip",
        rank=rng.randrange(nproc),
        at_step=rng.randrange(save_every + 1, steps - save_every),
        phase=rng.choice(SDC_PHASES),
    )
    return Scenario(
        name=name,
        recipe="train_ddp.py",
        nproc=nproc,
        steps=steps,
        save_every=save_every,
        hot=rng.random() < hot_fraction,
        numeric=numeric_defaults("bitflip"),
        faults=[fault],
    )


def repeated(
    kind: str,
    recipe: str,
    seed: int,
    count: int,
    *,
    hot: bool = True,
    numeric: dict[str, Any] | None = None,
    nproc: int = 2,
) -> list[Scenario]:
    """`count` runs of one fault `kind` on `recipe`, its rank, step and phase drawn from `seed`:
    the hot/cold counts of one fault class (issue 31: `sigstop` and `hang` in hot mode).
    A numerical fault is in the forward (a bitflip: any phase of SDC_PHASES), with
    `numeric_defaults(kind)` and then `numeric` as the run's RESILIENT_NUMERIC. `nproc`
    ranks (3: a bitflip's odd rank named by the majority)."""
    rng = random.Random(f"repeat-{kind}-{recipe}-{seed}")
    steps, save_every = 24, 4
    settings = {**numeric_defaults(kind), **(numeric or {})}
    out = []
    for i in range(count):
        rank = rng.randint(0, 1)
        at_step = rng.randint(save_every + 1, steps - save_every - 1)
        # drawn for every kind: the old kinds keep their draws; a bitflip, any phase
        phase = rng.choice(SDC_PHASES if kind in SDC else _IN_STEP)
        if nproc > 2:  # after the old draws: a 2-rank run of a seed stays what it was
            rank = rng.randrange(nproc)
        out.append(
            Scenario(
                name=f"repeat-{kind}-{recipe.removesuffix('.py')}-{seed}-{i:04d}",
                recipe=recipe,
                nproc=nproc,
                steps=steps,
                save_every=save_every,
                hot=hot,
                numeric=dict(settings) if kind in NUMERIC or numeric else {},
                faults=[
                    Fault(
                        kind=kind,
                        rank=rank,
                        at_step=at_step,
                        phase="forward" if kind in POISON else phase,
                    )
                ],
            )
        )
    return out


_MESHES = {
    "dp x tp": ({"dp_replicate": 1, "dp_shard": 2, "tp": 2}, [(1, 1, 2), (1, 2, 1)]),
    "replicate x shard": ({"dp_replicate": 2, "dp_shard": 2, "tp": 1}, [(1, 2, 1), (2, 1, 1)]),
}
"""The soak's 4-rank meshes, each with the 2-rank meshes a resize may go to: the
data-parallel degree halved, or (dp x tp) the tensor-parallel degree."""
_MESH_STEPS = 16
_MESH_KINDS = ("kill", "sigstop", "nan")


def _draw_mesh(
    rng: random.Random, name: str, save_every: int, hot_fraction: float, hot_lost: bool
) -> Scenario:
    """recipes/train_nd.py on a drawn 4-rank mesh (chaos/mesh.py), 16 steps: one or two of a
    kill, a SIGSTOP and a NaN on any rank, hot for `hot_fraction` of the draws (only with
    `hot_lost`: the kill and the stop need --hot-recovery); a cold draw's last fault is a
    resize to a drawn 2-rank mesh for a third of them. HSDP's hot draws need its hot
    recovery (issue 36 item 3): until then they go cold after a stall and fail (g)."""
    start, targets = _MESHES[rng.choice(sorted(_MESHES))]
    hot = hot_lost and rng.random() < hot_fraction
    n = rng.randint(1, 2)
    at = sorted(rng.sample(range(save_every + 1, _MESH_STEPS - save_every), n))
    faults = [Fault(kind=rng.choice(_MESH_KINDS), rank=rng.randrange(4), at_step=s) for s in at]
    if not hot and rng.random() < 1 / 3:
        rep, shard, tp = rng.choice(targets)
        mesh = {"dp_replicate": rep, "dp_shard": shard, "tp": tp}
        faults[-1] = Fault(kind="resize", rank=0, at_step=at[-1], mesh=mesh)
    return Scenario(
        name=name,
        recipe="train_nd.py",
        nproc=4,
        mesh=dict(start),
        steps=_MESH_STEPS,
        save_every=save_every,
        corpus_chars=40_000,
        timeout_s=480.0,  # 4 ranks on the 2-core machine: the toy's steps take 4x as long
        hot=hot,
        faults=faults,
    )


def _draw_hot(
    rng: random.Random, name: str, steps: int, save_every: int, max_faults: int, lost: bool
) -> Scenario:
    kinds = sorted((HOT_KINDS if lost else HOT_KINDS - LOST_PROCESS) - {"kill_during_replication"})
    n = rng.randint(1, max_faults)
    at = sorted(rng.sample(range(save_every + 1, steps - save_every), n))
    faults = [
        Fault(kind=rng.choice(kinds), rank=rng.randint(0, 1), at_step=s, phase=rng.choice(_IN_STEP))
        for s in at
    ]
    storage = "s3" if rng.random() < 0.25 else "local"
    # half of the draws that only lose processes run FSDP2 (its shards come from the buddy's
    # replica), and half of their kills inside a snapshot come during its replication
    recipe = "train_ddp.py"
    if lost and all(f.kind in LOST_PROCESS for f in faults) and rng.random() < 0.5:
        recipe = "train_fsdp.py"
        faults = [
            dataclasses.replace(f, kind="kill_during_replication")
            if f.kind == "kill_during_snapshot" and rng.random() < 0.5
            else f
            for f in faults
        ]
    return Scenario(
        name=name,
        recipe=recipe,
        steps=steps,
        save_every=save_every,
        storage=storage,
        hot=True,
        faults=_after_saves(faults, save_every, steps),
    )


def _after_saves(faults: list[Fault], save_every: int, steps: int) -> list[Fault]:
    """A `kill_during_save` fires at the first save after its step, up to `save_every` steps
    later, and a hot recovery resumes there, not at a checkpoint before: a later fault of the
    same draw must come after that save, or its step is never run again (soak 2026, run 0145,
    waited for ever for an OOM at step 13 after a kill during save 16). Such faults move past
    it, or go when the run ends first."""
    out: list[Fault] = []
    floor = 0
    for f in faults:
        if f.at_step < floor:
            if floor >= steps - 1:
                continue
            f = dataclasses.replace(f, at_step=floor)
        out.append(f)
        if f.kind == "kill_during_save":
            floor = max(floor, -(-(f.at_step + 1) // save_every) * save_every + 1)
    return out


def _draw_cold(
    rng: random.Random, seed: int, i: int, steps: int, save_every: int, max_faults: int
) -> Scenario:
    storage = "s3" if rng.random() < 0.25 else "local"
    kinds = sorted(
        k
        for k in FAULT_KINDS
        if (storage == "s3" or k not in S3_ONLY)
        and k not in TWO_HOSTS
        and k not in HOT_ONLY
        and k not in NUMERIC  # drawn by a generator of their own (generate)
        and k != "resize"  # mesh runs only (_draw_mesh)
    )
    if storage == "s3":
        kinds.remove("disk_full")
    n = rng.randint(1, max_faults)
    # a save between faults, and one before the end, so every fault meets a save
    at = sorted(rng.sample(range(save_every + 1, steps - save_every), n))
    storage_kinds = sorted(S3_ONLY) if storage == "s3" else []
    faults = [
        Fault(
            # on S3, half the faults are the storage's own
            kind=rng.choice(storage_kinds if storage_kinds and rng.random() < 0.5 else kinds),
            rank=rng.randint(0, 1),
            at_step=s,
            phase=rng.choice(_PHASES),
        )
        for s in at
    ]
    return Scenario(
        name=f"soak-{seed}-{i:04d}",
        steps=steps,
        save_every=save_every,
        recipe=rng.choice(["train_ddp.py", "train_fsdp.py"]),
        storage=storage,
        faults=faults,
    )
