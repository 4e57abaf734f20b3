"""An optimizer's state in torch's nested `get_optimizer_state_dict` form, rebuilt from the
flat entries DCP saved, with its parameter names renamed as the model's keys are."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from resilient.weights.names import plain_name

__all__ = ["nest", "renamed"]


def nest(flat: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """The nested dict whose DCP flattening is `flat` (key -> value), through DCP's map of
    each flat key to its path in the nested dict (Metadata.planner_data; the first element
    of each path, "optim", is left out)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        _set_path(nested, paths[key][1:], value)
    return nested


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """root[p0][p1]...[pn] = value, creating dicts (str keys) and lists (int indices) on the
    way, as DCP's flattening had them."""
    node: Any = root
    for here, nxt in itertools.pairwise(path):
        child = _get(node, here)
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            _put(node, here, child)
        node = child
    _put(node, path[-1], value)


def _get(node: Any, key: Any) -> Any:
    if isinstance(node, list):
        return node[key] if key < len(node) else None
    return node.get(key)


def _put(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        node[key] = value
    else:
        node[key] = value


def renamed(osd: dict[str, Any], rename: Callable[[str], str | None]) -> dict[str, Any]:
    """`osd` with its parameter names (the keys of "state", the "params" of each group)
    made plain and renamed; the state of a dropped parameter goes too."""

    def new(name: Any) -> Any:
        return rename(plain_name(name)) if isinstance(name, str) else name

    out = dict(osd)
    if isinstance(osd.get("state"), dict):
        state = {}
        for key, value in osd["state"].items():
            name = new(key)
            if name is not None:
                state[name] = value
        out["state"] = state
    if isinstance(osd.get("param_groups"), list):
        groups = []
        for group in osd["param_groups"]:
            if isinstance(group, dict) and isinstance(group.get("params"), list):
                params = [new(p) for p in group["params"]]
                group = {**group, "params": [p for p in params if p is not None]}
            groups.append(group)
        out["param_groups"] = groups
    return out
