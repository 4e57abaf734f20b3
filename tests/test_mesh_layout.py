"""The mesh by role (resilient/mesh/layout.py): pure rules, in milliseconds."""

from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.mesh import MeshLayout

pytestmark = pytest.mark.timeout(30)


def _mesh(names, shape, roles=None, replicated=()):
    world = 1
    for s in shape:
        world *= s
    return MeshLayout.build(
        names, shape, list(range(world)), world_size=world, roles=roles, replicated=replicated
    )


def test_dp_by_tp_counts_data_parallel_ranks_only() -> None:
    m = _mesh(("dp", "tp"), (2, 2))
    assert m.world_size == 4 and m.dp_degree == 2 and m.size("tp") == 2
    assert [m.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert m.same_batch(1) == [0, 1] and m.same_batch(2) == [2, 3]
    assert m.model_parallel
    assert m.replicas(0) == [0]  # fully_shard over "dp": no replica of rank 0's shard


def test_hsdp_replicate_peers_and_flattened_dp_coordinate() -> None:
    m = _mesh(("dp_replicate", "dp_shard"), (2, 2))
    assert m.dp_degree == 4 and not m.model_parallel
    assert [m.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert m.replicas(1) == [1, 3] and m.replicas(2) == [0, 2]
    assert m.same_batch(3) == [3]


def test_three_d_mesh_coordinates() -> None:
    m = _mesh(("pp", "dp_shard", "tp"), (2, 2, 2))
    assert m.coords(5) == (1, 0, 1)
    assert m.dp_rank(5) == 0 and m.dp_degree == 2
    assert m.same_batch(0) == [0, 1, 4, 5]


def test_a_dp_dimension_replicated_by_ddp_is_a_replicate_dimension() -> None:
    m = _mesh(("dp", "tp"), (2, 2), replicated=("dp",))
    assert m.replicas(0) == [0, 2]


def test_rank_grid_not_in_order() -> None:
    m = MeshLayout.build(("dp", "tp"), (2, 2), [0, 2, 1, 3], world_size=4)
    assert m.same_batch(2) == [0, 2] and m.dp_rank(1) == 1


def test_signature_and_what_changed() -> None:
    flat = MeshLayout.flat(4)
    assert flat.signature() == ""  # old checkpoints compare equal to a flat world
    dp_tp = _mesh(("dp", "tp"), (2, 2))
    assert dp_tp.change_from(dp_tp.signature(), 4) == "same"
    assert _mesh(("dp", "tp"), (1, 2)).change_from(dp_tp.signature(), 4) == "dp"
    assert _mesh(("dp", "tp"), (2, 1)).change_from(dp_tp.signature(), 4) == "model"
    assert MeshLayout.flat(2).change_from("", 4) == "dp"
    assert _mesh(("dp", "tp"), (2, 2)).change_from("", 4) == "model"


def test_unknown_names_and_submeshes_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="mesh_roles"):
        _mesh(("dp", "ep"), (2, 2))
    assert _mesh(("dp", "ep"), (2, 2), roles={"ep": "tp"}).size("tp") == 2
    with pytest.raises(ConfigError, match="not one of"):
        _mesh(("dp", "ep"), (2, 2), roles={"ep": "expert"})
    with pytest.raises(ConfigError, match="world mesh"):
        MeshLayout.build(("tp",), (2,), [0, 1], world_size=4)
    with pytest.raises(ConfigError, match="names"):
        MeshLayout.build((None, None), (2, 2), [0, 1, 2, 3], world_size=4)  # type: ignore[arg-type]
