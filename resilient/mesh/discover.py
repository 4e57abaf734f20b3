"""Finding the layout of a run: from the DeviceMesh the script passes to `track()`, or from
the DTensor parameters of the tracked model, or (neither) one flat data-parallel world.

Which data dimensions hold replicas is read from the parameters: a dimension along which
every DTensor parameter is placed `Replicate()`, or that the parameters' mesh does not
include (DDP over it), holds identical copies; one along which any parameter is sharded
does not. With no DTensor parameter, a DDP model replicates along every data dimension;
anything else is taken as sharded, which only means that nothing compares ranks as replicas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from resilient.errors import ConfigError
from resilient.mesh.layout import DATA_ROLES, MeshLayout, role_of_name

__all__ = ["discover"]


def discover(
    model: nn.Module | None,
    mesh: Any,
    *,
    world_size: int,
    roles: Mapping[str, str] | None = None,
) -> MeshLayout:
    """The run's layout. `mesh`: the world DeviceMesh, or None to find it from the model's
    DTensor parameters. Raises ConfigError when no mesh spanning the world can be found but
    the parameters show one exists, or when a dimension cannot be placed."""
    params = [p for p in model.parameters()] if model is not None else []
    dtensors: list[DTensor] = [p for p in params if isinstance(p, DTensor)]
    ddp = model is not None and any(isinstance(m, DistributedDataParallel) for m in model.modules())
    if mesh is None:
        mesh = _mesh_of(dtensors, world_size)
    if mesh is None:
        if roles:
            raise ConfigError("mesh_roles needs mesh=...: the model holds no DTensor parameter")
        return MeshLayout.flat(world_size, replicated=ddp and not dtensors)
    names = tuple(mesh.mesh_dim_names or ())
    if not names and mesh.mesh.dim() == 1:  # fully_shard's default mesh: one unnamed dimension
        return MeshLayout.flat(world_size, replicated=_replicated_along(dtensors, None, ddp))
    replicated = [
        n
        for n in names
        if (roles or {}).get(n, role_of_name(n) or "") in DATA_ROLES
        and _replicated_along(dtensors, n, ddp)
    ]
    grid = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
    return MeshLayout.build(
        names,
        tuple(mesh.mesh.shape),
        grid,
        world_size=world_size,
        roles=roles,
        replicated=replicated,
    )


def _mesh_of(dtensors: Sequence[DTensor], world_size: int) -> Any:
    """The mesh of the parameters with the most dimensions, if it spans the world; None
    without DTensor parameters. ConfigError when they live on sub-meshes only."""
    if not dtensors:
        return None
    mesh = max((p.device_mesh for p in dtensors), key=lambda m: m.ndim)
    if mesh.size() != world_size:
        dims = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=False))
        raise ConfigError(
            f"the model's DTensor parameters live on a mesh of {mesh.size()} of the "
            f"{world_size} ranks ({dims}): "
            "pass the world mesh to track(mesh=...) so the runtime knows every dimension"
        )
    return mesh


def _replicated_along(dtensors: Sequence[DTensor], name: str | None, ddp: bool) -> bool:
    """Whether every parameter is the same along mesh dimension `name` (None: the
    parameters' only dimension)."""
    if not dtensors:
        return ddp
    for p in dtensors:
        dims = tuple(p.device_mesh.mesh_dim_names or ())
        if name is None:
            idx = 0 if p.device_mesh.ndim == 1 else -1
        else:
            idx = dims.index(name) if name in dims else -1
        if idx < 0:
            if not ddp:  # not on the parameters' mesh and no DDP: nothing says replicated
                return False
            continue
        if not isinstance(p.placements[idx], Replicate):
            return False
    return True
