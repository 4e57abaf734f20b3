"""The device mesh by role (layout.py): data-parallel and model-parallel dimensions, the
data-parallel degree and coordinate, replicate peers. Built once at `track()` from the
user's DeviceMesh or the tracked DTensor parameters (discover.py) and handed down."""

from resilient.mesh.layout import DATA_ROLES, ROLES, Dim, MeshLayout, role_of_name

__all__ = ["DATA_ROLES", "ROLES", "Dim", "MeshLayout", "role_of_name"]
