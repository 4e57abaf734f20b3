"""Scenarios on a device mesh (issue 36): recipes/train_nd.py on a ("dp_replicate",
"dp_shard", "tp") mesh, the `resize` fault that relaunches it on another mesh, and the check
that every step trained on exactly the samples of the sampler's order.

    name = "mesh-kill"
    recipe = "train_nd.py"
    nproc = 4
    mesh = {dp_replicate = 1, dp_shard = 2, tp = 2}
    corpus_chars = 40000

    [[fault]]
    kind = "resize"      # SIGKILL the whole launch at step 6, relaunch on this mesh
    at_step = 6
    mesh = {dp_replicate = 1, dp_shard = 1, tp = 2}

A resize kills the launcher and every worker at once (the job lost its allocation) and
launches the recipe again on the fault's mesh, as a scheduler would on what it has left. The
checkpoint adapts: a data-parallel change keeps the global batch by accumulation and the
exact sample; a tensor-parallel change reshards the weights and the optimizer. Float sums
are taken in another order on another mesh, so bitwise equality with the fault-free run ends
at the resize (as after a node loss): (a) asks that the run finish, and the sample check
below that every step, before and after, trained on the samples the sampler's order gives
it, gathered from the recipe's `--sample-log` (a line per rank and step).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos.scenario import Scenario

__all__ = [
    "DIMS",
    "MESH_RECIPE",
    "check_mesh",
    "check_samples",
    "mesh_args",
    "toml_value",
    "worlds",
]

MESH_RECIPE = "train_nd.py"
RECIPES = ("train_ddp.py", "train_fsdp.py", MESH_RECIPE)
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""recipes/train_nd.py's mesh dimensions, outermost first (its --pp, --dp-replicate,
--dp-shard and --tp); pp is left out of a mesh of one stage."""
BATCH = 8
"""The per-rank batch size the harness runs every recipe with (chaos/launch.py)."""
_BLOCK = 64
"""The recipes' sequence length: a sample is 64 characters of the corpus."""


def size(mesh: Mapping[str, int]) -> int:
    return math.prod(int(mesh.get(d, 1)) for d in DIMS)


def dp_degree(mesh: Mapping[str, int]) -> int:
    return int(mesh.get("dp_replicate", 1)) * int(mesh.get("dp_shard", 1))


def describe(mesh: Mapping[str, int]) -> str:
    dims = DIMS if int(mesh.get("pp", 1)) > 1 else DIMS[1:]  # pp=1: the names before pp
    return ("pp" if len(dims) == len(DIMS) else "") + "x".join(
        str(int(mesh.get(d, 1))) for d in dims
    )


def mesh_args(mesh: Mapping[str, int]) -> list[str]:
    """train_nd.py's flags for `mesh` ({} : none, its defaults)."""
    if not mesh:
        return []
    return [
        f"--{d.replace('_', '-')}={int(mesh.get(d, 1))}" for d in DIMS if d in mesh or d != "pp"
    ]


def _samples(corpus_chars: int) -> int:
    """The recipes' dataset length for a corpus of `corpus_chars` characters."""
    return max(0, (corpus_chars - 1) // _BLOCK)


def _check_one(sc: Scenario, mesh: Mapping[str, Any], where: str) -> None:
    unknown = set(mesh) - set(DIMS)
    if unknown:
        raise ValueError(f"{sc.name}: {where} names {sorted(unknown)}: known {list(DIMS)}")
    if any(not isinstance(v, int) or v < 1 for v in mesh.values()):
        raise ValueError(f"{sc.name}: {where} sizes must be integers >= 1, got {dict(mesh)}")


def check_mesh(sc: Scenario) -> None:
    """ValueError with the reason for a mesh scenario that cannot run as written."""
    resizes = [f for f in sc.faults if f.kind == "resize"]
    if sc.hot and sc.recipe not in RECIPES:
        raise ValueError(f"{sc.name}: hot mode runs one of {list(RECIPES)}")
    for f in sc.faults:
        if (f.mesh is not None) != (f.kind == "resize"):
            raise ValueError(
                f"{sc.name}: a fault's mesh is the resize's new mesh, and a resize needs one"
            )
    if not sc.mesh:
        if sc.recipe == MESH_RECIPE or resizes:
            raise ValueError(f"{sc.name}: {MESH_RECIPE} and resize need mesh = {{...}}")
        return
    if sc.recipe != MESH_RECIPE:
        raise ValueError(f"{sc.name}: mesh = {{...}} runs {MESH_RECIPE}, not {sc.recipe}")
    _check_one(sc, sc.mesh, "mesh")
    if sc.hosts != 1 or size(sc.mesh) != sc.nproc:
        raise ValueError(
            f"{sc.name}: the mesh {describe(sc.mesh)} has {size(sc.mesh)} ranks: set "
            f"nproc = {size(sc.mesh)} (one host)"
        )
    if resizes and sc.hot:
        raise ValueError(
            f"{sc.name}: a resize relaunches the job on another world; hot recovery replaces "
            "a process in the same one: run resize scenarios cold"
        )
    gb = BATCH * dp_degree(sc.mesh)
    n = _samples(sc.corpus_chars)
    for f in resizes:
        assert f.mesh is not None
        _check_one(sc, f.mesh, f"the resize at step {f.at_step}")
        if gb % (BATCH * dp_degree(f.mesh)):
            raise ValueError(
                f"{sc.name}: the global batch {gb} does not split over the data-parallel "
                f"degree {dp_degree(f.mesh)} of the resize's mesh {describe(f.mesh)}"
            )
    for mesh in (sc.mesh, *(f.mesh for f in resizes if f.mesh is not None)):
        dp = dp_degree(mesh)
        accum = gb // (BATCH * dp)
        if (n // dp) // BATCH // accum < sc.steps:  # the sample check reads epoch 0 alone
            need = sc.steps * gb * _BLOCK + _BLOCK * dp * BATCH
            raise ValueError(
                f"{sc.name}: {sc.steps} steps of {gb} samples do not fit one epoch of "
                f"{sc.corpus_chars} characters on the mesh {describe(mesh)}: set "
                f"corpus_chars >= {need}"
            )
    shrinking = [f for f in sc.faults if f.kind != "resize"]
    for f in shrinking:
        world = _world_at(sc, f.at_step)
        if f.rank >= world:
            raise ValueError(f"{sc.name}: fault rank {f.rank} not in the world of {world} then")


def _world_at(sc: Scenario, step: int) -> int:
    world = size(sc.mesh)
    for f in sorted(sc.faults, key=lambda f: f.at_step):
        if f.kind == "resize" and f.at_step < step and f.mesh is not None:
            world = size(f.mesh)
    return world


def worlds(sc: Scenario) -> list[int]:
    """Every world size the scenario runs on (a resize adds one)."""
    return [sc.nproc * sc.hosts] + [size(f.mesh) for f in sc.faults if f.mesh is not None]


# ---------------------------------------------------------------------- the sample check
def _order(n: int, seed: int) -> list[int]:
    """Epoch 0 of StatefulDistributedSampler(shuffle=True, seed=seed): one permutation."""
    import torch

    return [int(i) for i in torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


def _latest(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """step -> the records of the attempt that ran it last: the newest record's world, and
    each of its ranks' last record of the step (a log is appended in time order)."""
    by: dict[tuple[int, int], dict[str, Any]] = {}
    for r in records:
        by[(int(r["step"]), int(r["rank"]))] = r
    out: dict[int, list[dict[str, Any]]] = {}
    for step in sorted({s for s, _ in by}):
        mine = [r for (s, _), r in by.items() if s == step]
        newest = max(mine, key=lambda r: float(r["t"]))
        out[step] = [
            r for r in mine if r["world"] == newest["world"] and r["rank"] < newest["world"]
        ]
    return out


def check_samples(sc: Scenario, sample_dir: Path, failures: list[str]) -> str:
    """Every step 0..steps-1 trained, on the attempt that ran it last, on exactly the samples
    the sampler's order gives it: the global batch at the step's offset in epoch 0, split
    over the data-parallel ranks, tp peers on the same ones. Appends failures; returns the
    check's summary."""
    from recipes.common.data import build_dataset

    records: list[dict[str, Any]] = []
    for path in sorted(sample_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    n = len(build_dataset(block_size=_BLOCK, num_chars=sc.corpus_chars, seed=sc.seed)[0])
    order, gb = _order(n, sc.seed), BATCH * dp_degree(sc.mesh)
    latest = _latest(records)
    bad: list[str] = []
    if sorted(latest) != list(range(sc.steps)):
        bad.append(
            f"steps logged {sorted(latest)[:3]}...{sorted(latest)[-3:]}, not 0..{sc.steps - 1}"
        )
    shapes: set[tuple[int, int, int]] = set()
    for step, recs in latest.items():
        by_dp: dict[int, list[int]] = {}
        for r in recs:
            shapes.add((int(r["world"]), int(r["dp"]), int(r["accum"])))
            if by_dp.setdefault(int(r["dp_rank"]), r["ids"]) != r["ids"]:
                bad.append(f"step {step}: rank {r['rank']} drew other samples than its tp peers")
        ids = sorted(i for v in by_dp.values() for i in v)
        want = sorted(order[step * gb : (step + 1) * gb])
        if ids != want:
            bad.append(f"step {step}: trained on {len(ids)} samples, not the {gb} of its offset")
    failures += [f"samples: {b}" for b in bad[:5]]
    worlds_seen = ", ".join(f"world {w} dp {d} x{a}" for w, d, a in sorted(shapes))
    head = "pass" if not bad else f"fail ({len(bad)} problems)"
    return f"{head} ({len(latest)} steps, global batch {gb}; {worlds_seen})"


def toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)
