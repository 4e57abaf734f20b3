"""Plain names of state-dict keys, a user's renaming file (`--map`), and key filters.

A state dict taken from a wrapped model carries the wrappers' attribute names in its keys:
`module.` (DDP, DataParallel), `_orig_mod.` (torch.compile), `_fsdp_wrapped_module.` (FSDP1)
and `_checkpoint_wrapped_module.` (activation checkpointing). `plain_name` takes them out
wherever they sit in the dotted path, so the key is the one the bare model has. (A resilient
checkpoint's own top-level `model.` is its reader's business, not a wrapper.) One catch: a
submodule that is really named `module` loses that part of its name too; two keys that end up
the same are refused by whoever builds the names, naming both.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from resilient.errors import ConfigError

__all__ = ["WRAPPER_PARTS", "KeyMap", "load_key_map", "matches_any", "plain_name"]

WRAPPER_PARTS = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
)
"""Attribute names that wrappers put between a model's own names."""

KeyMap = Callable[[str], "str | None"]
"""A renaming: plain name -> new name, or None to drop the key."""


def plain_name(key: str) -> str:
    """`key` without wrapper parts (WRAPPER_PARTS) anywhere in its dotted path:
    `module._orig_mod.layers.0._checkpoint_wrapped_module.mlp.weight` -> `layers.0.mlp.weight`.
    """
    parts = key.split(".")
    kept = [p for p in parts if p not in WRAPPER_PARTS]
    return ".".join(kept) if len(kept) != len(parts) else key


def matches_any(name: str, globs: Iterable[str]) -> bool:
    """Whether `name` matches one of the shell-style patterns `globs` (fnmatch, case
    sensitive): `lm_head.*`, `*.bias`, `layers.1[0-9].*`."""
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def load_key_map(path: str | os.PathLike[str]) -> KeyMap:
    """The `rename(name: str) -> str | None` of the user's Python file `path` (`--map`),
    checked on every call: a name (str) renames the key, None drops it.

    For example, a file holding

        def rename(name):
            if name.startswith("aux_head."):
                return None                      # not exported
            return "model." + name               # the layout another library expects

    ConfigError, naming the file, when it does not exist, fails to run or has no `rename`.
    The file is run as Python: it is the user's own code, as a script is.
    """
    file = Path(os.fspath(path))
    if not file.is_file():
        raise ConfigError(
            f"--map {file}: no such file; give a Python file that defines "
            "`def rename(name: str) -> str | None`"
        )
    spec = importlib.util.spec_from_file_location(f"_resilient_key_map_{abs(hash(file))}", file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--map {file}: not a Python file that can be loaded")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs to fix, say which
        raise ConfigError(f"--map {file}: running it failed ({type(e).__name__}: {e})") from e
    fn = getattr(module, "rename", None)
    if not callable(fn):
        raise ConfigError(
            f"--map {file}: defines no function `rename`; it must define "
            "`def rename(name: str) -> str | None` (None drops the key)"
        )

    def rename(name: str) -> str | None:
        try:
            new = fn(name)
        except Exception as e:
            raise ConfigError(
                f"--map {file}: rename({name!r}) raised {type(e).__name__}: {e}"
            ) from e
        if new is not None and (not isinstance(new, str) or not new):
            raise ConfigError(
                f"--map {file}: rename({name!r}) returned {new!r}; it must return a non-empty "
                "str (the new name) or None (drop the key)"
            )
        return new

    return rename
