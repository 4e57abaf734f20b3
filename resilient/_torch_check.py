"""The check every compat module runs at import: does this torch still have what we use?

resilient leans on a few private torch names where torch has no public way to do the job
(docs/internals.md#private-apis). Each compat module states what it needs through the helpers
here, at import, so a torch that renamed or dropped one fails at once with an error naming
the torch version, the missing name and the feature that needs it: never later in the middle
of a run, and never through a silent `getattr(..., default)`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "TESTED_TORCH",
    "TorchCompatError",
    "missing",
    "require_attrs",
    "require_import",
    "require_params",
    "require_self_attrs",
]

TESTED_TORCH = "2.13"
"""The torch release these checks were written against (the floor in pyproject.toml)."""


class TorchCompatError(ImportError):
    """The installed torch lacks a private name resilient relies on; the message says which,
    for which feature, and what to do."""


def missing(what: str, feature: str) -> TorchCompatError:
    """The error for a missing `what` that `feature` needs (for checks the helpers below
    cannot express)."""
    return TorchCompatError(
        f"resilient: torch {torch.__version__} has no {what}, which {feature} needs. "
        f"resilient was tested with torch {TESTED_TORCH}: install that release, or report "
        "this torch version as unsupported (docs/internals.md#private-apis)"
    )


def _name(owner: Any) -> str:
    """For messages only: a class's or function's qualified name, a module's name."""
    for attr in ("__qualname__", "__name__"):
        if isinstance(getattr(owner, attr, None), str):
            return str(getattr(owner, attr))
    return repr(owner)


def require_import(module: str, name: str, *, feature: str) -> Any:
    """`module.name`, imported; TorchCompatError naming it and `feature` when it is missing."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(f"{module}.{name}", feature) from None


def require_attrs(owner: Any, names: Iterable[str], *, feature: str) -> None:
    """Every name in `names` is an attribute of `owner` (a class or module)."""
    for n in names:
        if not hasattr(owner, n):
            raise missing(f"{_name(owner)}.{n}", feature)


def require_params(func: Any, params: Iterable[str], *, feature: str) -> None:
    """`func`'s signature has these parameters, in this order (after `self`): the contract of
    a private method we override or call."""
    try:
        have = [p for p in inspect.signature(func).parameters if p != "self"]
    except (TypeError, ValueError):
        raise missing(f"a readable signature of {_name(func)}", feature) from None
    want = list(params)
    if have[: len(want)] != want:
        raise missing(f"{_name(func)}({', '.join(want)}) (it takes ({', '.join(have)}))", feature)


def require_self_attrs(cls: type, names: Iterable[str], *, feature: str) -> None:
    """Instances of `cls` get these attributes: its source (its own or a base class's) assigns
    `self.<name>`. Instance attributes set in `__init__` cannot be checked on the class."""
    sources = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch"):
            try:
                sources.append(inspect.getsource(klass))
            except (OSError, TypeError):
                raise missing(f"readable source for {_name(klass)}", feature) from None
    text = "\n".join(sources)
    for n in names:
        if f"self.{n} =" not in text and f"self.{n}:" not in text:
            raise missing(f"{_name(cls)}.{n}", feature)
