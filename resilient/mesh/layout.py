"""The device mesh by role: which dimensions are data parallel and which split the model.

A run on one `DeviceMesh` (dp x tp, HSDP's replicate x shard, dp x cp x tp, ...) has a world
size that is *not* its data-parallel degree. Everything that counts data (the data position,
the global batch, gradient accumulation) must count the data-parallel dimensions only, and
everything that compares replicas (the SDC check, hot recovery's buddies) must look along
the replicate dimension only. `MeshLayout` is the one object that knows which is which: it is
built once at `track()`, handed to the parts that ask, and nothing else computes ranks from
the world size by arithmetic.

Roles:
- ``replicate``: data parallel, every coordinate holds the same parameters (DDP, HSDP's
  replicate dimension);
- ``shard``: data parallel, parameters sharded along it (FSDP2, HSDP's shard dimension);
- ``tp``, ``cp``, ``pp``: model parallel (tensor, context, pipeline). Peers along them draw the
  same batch.

Pure logic over the mesh's rank grid (no process group is touched), so the rules are tested
in milliseconds and every rank computes the same answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resilient.errors import ConfigError

__all__ = ["DATA_ROLES", "ROLES", "Dim", "MeshLayout", "role_of_name"]

DATA_ROLES = ("replicate", "shard")
MODEL_ROLES = ("tp", "cp", "pp")
ROLES = (*DATA_ROLES, *MODEL_ROLES)

# the names torchtitan, torch's tutorials and common scripts give mesh dimensions
_NAMES: dict[str, str] = {
    "dp_replicate": "replicate",
    "replicate": "replicate",
    "ddp": "replicate",
    "dp_shard": "shard",
    "shard": "shard",
    "fsdp": "shard",
    "dp": "shard",  # refined to replicate when the parameters are replicated along it
    "data": "shard",
    "tp": "tp",
    "tensor": "tp",
    "cp": "cp",
    "context": "cp",
    "pp": "pp",
    "pipeline": "pp",
}


def role_of_name(name: str) -> str | None:
    """The role a dimension's name says, or None for a name the runtime cannot place."""
    return _NAMES.get(name.lower())


@dataclass(frozen=True, slots=True)
class Dim:
    name: str
    size: int
    role: str


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """The mesh's dimensions (outermost first) and its rank grid, row-major over them."""

    dims: tuple[Dim, ...]
    grid: tuple[int, ...]
    """`grid[i]` is the global rank at flat coordinate i (row-major over `dims`)."""

    # ------------------------------------------------------------------ building
    @staticmethod
    def flat(world_size: int, *, replicated: bool = False) -> MeshLayout:
        """No mesh: one data-parallel dimension over the whole world, replicated (DDP) or
        sharded (FSDP2, or not known: nothing then compares ranks as replicas)."""
        role = "replicate" if replicated else "shard"
        return MeshLayout((Dim("dp", world_size, role),), tuple(range(world_size)))

    @staticmethod
    def build(
        names: Sequence[str],
        shape: Sequence[int],
        grid: Sequence[int],
        *,
        world_size: int,
        roles: Mapping[str, str] | None = None,
        replicated: Sequence[str] = (),
    ) -> MeshLayout:
        """A layout from a mesh's dimension names, shape and rank grid.

        `roles` names a role for dimensions whose names are not known ones, or overrides
        them. `replicated`: dimensions along which the parameters are replicated (a "dp"
        dimension under DDP, as opposed to FSDP's sharding along it). Raises ConfigError for
        an unplaceable name, a mesh that does not span the world, or an unknown role."""
        roles = dict(roles or {})
        for name, role in roles.items():
            if role not in ROLES:
                raise ConfigError(
                    f"mesh role {role!r} for dimension {name!r} is not one of {list(ROLES)}"
                )
            if name not in names:
                raise ConfigError(
                    f"mesh_roles names dimension {name!r}, which the mesh {list(names)} lacks"
                )
        if len(names) != len(shape) or any(not n for n in names):
            raise ConfigError(
                "the mesh's dimensions need names (init_device_mesh(..., mesh_dim_names=...)) "
                "so the runtime can tell data parallelism from model parallelism"
            )
        dims = []
        for name, size in zip(names, shape, strict=True):
            found = roles.get(name) or role_of_name(name)
            if found is None:
                raise ConfigError(
                    f"mesh dimension {name!r} has no role the runtime knows: name it one of "
                    f"{sorted(_NAMES)}, or pass mesh_roles={{{name!r}: <role>}} to track() "
                    f"with a role from {list(ROLES)}"
                )
            if found == "shard" and name in replicated and name not in roles:
                found = "replicate"
            dims.append(Dim(str(name), int(size), found))
        if math.prod(d.size for d in dims) != world_size or sorted(grid) != list(range(world_size)):
            raise ConfigError(
                f"the mesh {dict(zip(names, shape, strict=True))} does not span the "
                f"{world_size} ranks of this run: pass the world mesh (the one "
                "init_device_mesh returned), not a sub-mesh of it"
            )
        dupes = [r for r in ROLES if r != "shard" and sum(d.role == r for d in dims) > 1]
        if dupes:
            raise ConfigError(f"the mesh has more than one dimension of role {dupes}")
        return MeshLayout(tuple(dims), tuple(int(r) for r in grid))

    @staticmethod
    def from_device_mesh(
        mesh: Any, *, world_size: int, roles: Mapping[str, str] | None = None
    ) -> MeshLayout:
        """From a torch DeviceMesh (`mesh.mesh` is its rank grid)."""
        names = tuple(mesh.mesh_dim_names or ())
        grid = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
        return MeshLayout.build(
            names, tuple(mesh.mesh.shape), grid, world_size=world_size, roles=roles
        )

    # ------------------------------------------------------------------ questions
    @property
    def world_size(self) -> int:
        return len(self.grid)

    def size(self, role: str) -> int:
        """The degree of a role (1 when the mesh has no such dimension)."""
        return math.prod(d.size for d in self.dims if d.role == role)

    @property
    def dp_degree(self) -> int:
        """How many different batches a step consumes: the data-parallel dimensions' product."""
        return math.prod(d.size for d in self.dims if d.role in DATA_ROLES)

    @property
    def model_parallel(self) -> bool:
        return any(d.role in MODEL_ROLES and d.size > 1 for d in self.dims)

    def coords(self, rank: int) -> tuple[int, ...]:
        """`rank`'s coordinate along each dimension."""
        flat = self.grid.index(rank)
        out = []
        for d in reversed(self.dims):
            out.append(flat % d.size)
            flat //= d.size
        return tuple(reversed(out))

    def _rank_at(self, coords: Sequence[int]) -> int:
        flat = 0
        for d, c in zip(self.dims, coords, strict=True):
            flat = flat * d.size + c
        return self.grid[flat]

    def dp_rank(self, rank: int) -> int:
        """`rank`'s data-parallel coordinate: row-major over the data dimensions in mesh
        order, as a flattened ("dp_replicate", "dp_shard") sub-mesh numbers it."""
        out = 0
        for d, c in zip(self.dims, self.coords(rank), strict=True):
            if d.role in DATA_ROLES:
                out = out * d.size + c
        return out

    def peers(self, rank: int, along: Sequence[str]) -> list[int]:
        """The ranks that differ from `rank` only along dimensions of the roles `along`
        (`rank` included), in grid order."""
        mine = self.coords(rank)
        return [
            r
            for r in self.grid
            if all(
                a == b or d.role in along
                for d, a, b in zip(self.dims, self.coords(r), mine, strict=True)
            )
        ]

    def replicas(self, rank: int) -> list[int]:
        """The ranks holding the same parameters as `rank` (same coordinate everywhere but
        along replicate dimensions): DDP's whole world, HSDP's replicate peers."""
        return self.peers(rank, ("replicate",))

    def same_batch(self, rank: int) -> list[int]:
        """The ranks that draw the same batch as `rank`: its tp, cp and pp peers."""
        return self.peers(rank, MODEL_ROLES)

    # ------------------------------------------------------------------ saving
    def describe(self) -> dict[str, int]:
        """{name: size} in mesh order, for events."""
        return {d.name: d.size for d in self.dims}

    def signature(self) -> str:
        """What must match for per-rank state to be loaded rank by rank: the world size and
        each dimension's role and size in order. "" for a flat data-parallel world, so that
        checkpoints saved before meshes were known compare equal to it."""
        if all(d.role in DATA_ROLES for d in self.dims) and len(self.dims) == 1:
            return ""
        return ",".join(f"{d.role}={d.size}" for d in self.dims)

    def change_from(self, saved: str, saved_world: int) -> str:
        """How this layout differs from a saved `signature()`: "same", "dp" (only the
        data-parallel degree changed, or a flat world resized) or "model" (a model-parallel
        degree changed: resharded, and not bitwise)."""
        if saved == self.signature() and saved_world == self.world_size:
            return "same"
        degrees = _model_degrees(saved)
        now = {r: self.size(r) for r in MODEL_ROLES}
        return "dp" if degrees == now else "model"


def _model_degrees(signature: str) -> dict[str, int]:
    out = {r: 1 for r in MODEL_ROLES}
    for part in filter(None, signature.split(",")):
        role, _, size = part.partition("=")
        if role in out:
            out[role] *= int(size)
    return out
