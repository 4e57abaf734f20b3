"""The check every compat module runs at import: is this torch a tested release, and does it
still have what we use?

First the release: resilient is tested on a range of torch minors, TORCH_FLOOR's to
TORCH_NEWEST's, any patch release of them (pyproject.toml declares the same range, `<2.16`;
docs/operating.md#torch-releases says what was checked on which). A newer minor than the
newest tested is warned about, not refused: pip's bound already keeps it out, so one that is
there was chosen. A release below the floor, or a pre-release or nightly build, fails at the
import of the first compat module with an error naming the range; RESILIENT_UNTESTED_TORCH=1
(resilient/envvars.py) turns that into a warning, for trying a new release.

Then the names: resilient leans on a few private torch names where torch has no public way
to do the job (docs/internals.md#private-apis). Each compat module states what it needs
through the helpers here, at import, so a torch that renamed or dropped one fails at once with
an error naming the torch version, the missing name and the feature that needs it: never
later in the middle of a run, and never through a silent `getattr(..., default)`. That holds
with RESILIENT_UNTESTED_TORCH=1 too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from resilient.envvars import ENV_UNTESTED_TORCH, untested_torch_allowed

__all__ = [
    "TESTED_MINORS",
    "TESTED_RANGE",
    "TESTED_RELEASES",
    "TORCH_FLOOR",
    "TORCH_NEWEST",
    "TorchCompatError",
    "check_release",
    "missing",
    "release",
    "require_attrs",
    "require_import",
    "require_params",
    "require_self_attrs",
]

TORCH_FLOOR = (2, 11, 0)
"""The oldest torch release tested: an older one lacks a name or a behaviour resilient relies
on (docs/operating.md#torch-releases)."""
TORCH_NEWEST = (2, 15, 0)
"""The newest torch release tested: the one place that names it (scripts/torch_env.py reads
this line for `make test-torch TORCH=newest` and CI's subset). Raise it only with the new
release checked by `make test-torch TORCH=<release>`, and pyproject.toml's bound with it."""
TESTED_RANGE = f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]},<{TORCH_NEWEST[0]}.{TORCH_NEWEST[1] + 1}"
"""The range as pip reads it (pyproject.toml's requirement; tests/test_torch_compat.py checks
that the two agree): every patch release of the tested minors."""

TESTED_RELEASES = ("2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")
"""The releases `make test-torch` was run on, oldest first (every compat module's docstring
names them: the releases its checks were run on)."""

TESTED_MINORS = frozenset(tuple(int(x) for x in r.split(".")[:2]) for r in TESTED_RELEASES)
"""The (major, minor) of every tested release: a patch release of one of them is accepted."""

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(\+[\w.]+)?")


class TorchCompatError(ImportError):
    """The installed torch lacks a private name resilient relies on; the message says which,
    for which feature, and what to do."""


def missing(what: str, feature: str) -> TorchCompatError:
    """The error for a missing `what` that `feature` needs (for checks the helpers below
    cannot express)."""
    return TorchCompatError(
        f"resilient: torch {torch.__version__} has no {what}, which {feature} needs. "
        f"resilient is tested with {TESTED_RANGE}: install a release in that range, or report "
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
    """Instances of `cls` get these attributes: the source files of its torch classes (its
    own or a base class's) assign `self.<name>`. Instance attributes set in `__init__` cannot
    be checked on the class. Whole files, read once: `inspect.getsource(cls)` parses its
    module to find a class, about 0.3 s for DDP's bases, at every process start."""
    sources = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch"):
            try:
                sources.append(_source_file(inspect.getsourcefile(klass)))
            except (OSError, TypeError):
                raise missing(f"readable source for {_name(klass)}", feature) from None
    text = "\n".join(sources)
    for n in names:
        if f"self.{n} =" not in text and f"self.{n}:" not in text:
            raise missing(f"{_name(cls)}.{n}", feature)


@functools.cache
def _source_file(path: str | None) -> str:
    if path is None:
        raise OSError("no source file")
    with open(path, encoding="utf-8") as f:
        return f.read()


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a torch version string ("2.15.1+cu130": a local build label
    is ignored); None for a pre-release, a nightly build or anything else."""
    match = _RELEASE.fullmatch(version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def check_release(version: str, *, allow_untested: bool = False) -> None:
    """Accept `version` (torch.__version__, e.g. "2.15.1+cu130"; a local build label is
    ignored) when it is any patch release of a tested minor. A newer minor than the newest
    tested is a warning, not a refusal. A release below the floor, a minor in the range that
    was never tested, a pre-release or nightly build, or no release at all raise
    TorchCompatError naming the range; a warning instead when `allow_untested`."""
    got = release(version)
    if got is not None and got >= TORCH_FLOOR and got[:2] in TESTED_MINORS:
        return
    if got is not None and got[:2] > TORCH_NEWEST[:2]:
        warnings.warn(
            f"resilient: torch {version} is a newer minor release than the newest tested, "
            f"{'.'.join(map(str, TORCH_NEWEST))} ({TESTED_RANGE}, "
            "docs/operating.md#torch-releases). Running anyway; the private torch names it "
            "uses are still checked at import. Report how it went.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    text = (
        f"resilient: torch {version} is not a release resilient is tested with "
        f"({TESTED_RANGE}, docs/operating.md#torch-releases)."
    )
    if allow_untested:
        warnings.warn(
            f"{text} Running anyway ({ENV_UNTESTED_TORCH}=1); the private torch names it "
            "uses are still checked at import.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    raise TorchCompatError(
        f"{text} Install a release in that range, or set {ENV_UNTESTED_TORCH}=1 to try this "
        "one anyway (and report how it went)."
    )


check_release(str(torch.__version__), allow_untested=untested_torch_allowed())
