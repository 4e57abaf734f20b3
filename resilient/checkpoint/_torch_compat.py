"""Every private DCP name the checkpoint subsystem relies on, checked once at import.

torch.distributed.checkpoint (DCP) has no public hook for some of what we do: storing a
value the way its load planner does, finding a reader's `.metadata`, knowing which file and
byte range a read item comes from, and loading into a fresh optimizer without the
zero-gradient step that set_optimizer_state_dict runs first. Each is taken here and nowhere
else, and checked when this module is imported: if a torch release renames or removes one,
importing resilient fails at once with an error naming the torch version and the feature,
never later with a silent default. One exception, 5. below: what only makes a save cheaper
turns itself off when it no longer holds, and DCP's public path is taken instead. What leans
on torch.save's archive format is in _torch_archive.py.

One behaviour differs inside the tested range, 6. below: before torch 2.13, DCP's stager can
stage only once, and the async save's stager is mended here.

Checked on torch 2.11.0, 2.12.0, 2.13.0, 2.14.1, 2.15.0 (the tested range,
resilient/_torch_check.py): every check below passes on each; which of the tests using them
ran on which release: docs/operating.md#torch-releases.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager

from resilient._torch_check import TorchCompatError, missing, release, require_self_attrs

__all__ = [
    "FQNS_UNAVAILABLE",
    "RecordSpan",
    "fqns_of",
    "keep_stager_usable",
    "metadata_path",
    "no_init_step",
    "planner_store",
    "read_span",
]


def _missing(what: str, why: str) -> TorchCompatError:
    return missing(f"{what} ({why})", "resilient's checkpoints")


# --- 1. storing a loaded value as DefaultLoadPlanner.load_bytes does ---------------------------
try:
    from torch.distributed.checkpoint._traverse import set_element as _set_element
except ImportError as e:  # pragma: no cover - depends on the torch release
    raise _missing("torch.distributed.checkpoint._traverse.set_element", str(e)) from e

_planner = DefaultLoadPlanner()
_planner.set_up_planner({}, None, False)
for _attr in ("flatten_state_dict", "original_state_dict", "mappings", "state_dict"):
    if not hasattr(_planner, _attr):  # pragma: no cover
        raise _missing(f"DefaultLoadPlanner.{_attr}", "attribute not set by set_up_planner")
del _planner


def planner_store(planner: DefaultLoadPlanner, fqn: str, value: Any) -> None:
    """Put a loaded non-tensor `value` for `fqn` into the planner's state dict, as
    DefaultLoadPlanner.load_bytes does after its own torch.load."""
    if planner.flatten_state_dict:
        _set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


# --- 2. where a reader's .metadata is ------------------------------------------------------------
if not callable(getattr(FileSystemReader, "_get_metadata_path", None)):  # pragma: no cover
    raise _missing("FileSystemReader._get_metadata_path", "method not found")


def metadata_path(reader: FileSystemReader, rank: int | None) -> Any:
    """The path of the `.metadata` file `reader` reads (rank-local when `rank` is given)."""
    return reader._get_metadata_path(rank)


# --- 3. the file and byte range of a read item -------------------------------------------------
try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError as e:  # pragma: no cover
    raise _missing("torch.distributed.checkpoint.filesystem._StorageInfo", str(e)) from e
_FIELDS = {"relative_path", "offset", "length"}
if not set(getattr(_StorageInfo, "__annotations__", {})) >= _FIELDS:  # pragma: no cover
    raise _missing("_StorageInfo.relative_path/offset/length", "fields not found")


class RecordSpan(NamedTuple):
    """Where DCP reads one ReadItem's record: its file, byte offset and length there."""

    file: str
    offset: int
    length: int
    transformed: bool
    """It went through a stream transform (`_extensions`) on its way to the file: its bytes
    there are not a torch.save archive."""


def read_span(reader: FileSystemReader, storage_index: Any) -> RecordSpan:
    """The record DCP reads for one ReadItem's `storage_index`, from the reader's
    storage_data (set by set_up_storage_reader)."""
    info = reader.storage_data[storage_index]
    transformed = bool(getattr(info, "transform_descriptors", None))
    return RecordSpan(str(info.relative_path), int(info.offset), int(info.length), transformed)


# --- 4. set_optimizer_state_dict's step on a fresh optimizer ---------------------------------
# On an optimizer with no state yet, set_optimizer_state_dict first runs one optimizer.step()
# with zero gradients and lr 0 (_init_optim_state), so that every state key exists. Then
# Optimizer.load_state_dict replaces the whole of optimizer.state with the loaded one: the
# step's only lasting effects are its cost (zero gradients and a full update: 50-100 ms of a
# resume at 100 MB of AdamW state, on the hot recovery's critical path) and the optimizer's
# step hooks firing for a step that never was. _init_optim_state returns at once when
# optimizer.state is not empty; a placeholder entry for the load makes it so.
try:
    from torch.distributed.checkpoint.state_dict import _init_optim_state
except ImportError as e:  # pragma: no cover
    raise _missing("torch.distributed.checkpoint.state_dict._init_optim_state", str(e)) from e
if "state" not in _init_optim_state.__code__.co_names:  # pragma: no cover
    raise _missing("_init_optim_state's check of optim.state", "it no longer looks at it")


@contextlib.contextmanager
def no_init_step(optimizer: torch.optim.Optimizer, state_names: Any = None) -> Iterator[None]:
    """Inside, set_optimizer_state_dict loads into a fresh `optimizer` without stepping it
    first. `state_names` ({param: [name, ...]}): for the flattened format, whose loader
    (_unflatten_optim_state_dict) takes each parameter's state names from the live state and
    found none in one empty placeholder: the load was empty, silently (internals.md
    #g-set-optim-step). {}: names not known, DCP's own step makes them. The placeholders
    are gone after a load (the state is replaced) or taken out here."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or not params or state_names == {}:
        yield
        return
    placeholders: dict[torch.Tensor, dict[str, Any]] = {params[0]: {}}
    if state_names is not None:
        placeholders = {p: dict.fromkeys(names) for p, names in state_names.items()}
    optimizer.state.update(placeholders)
    try:
        yield
    finally:
        for p, placeholder in placeholders.items():
            if optimizer.state.get(p) is placeholder:  # the load did not happen
                del optimizer.state[p]


# --- 5. the name DCP gives a model's parameter or state-dict key --------------------------------
# get_model_state_dict and get_optimizer_state_dict resolve every name with _get_fqns on each
# call; resilient/checkpoint/_state_dicts.py resolves them once and keeps the names. Only an
# optimisation: without it (FQNS_UNAVAILABLE says why) every call goes to DCP's public path.
FQNS_UNAVAILABLE: str | None = None
try:
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError as e:  # pragma: no cover
    FQNS_UNAVAILABLE = f"torch {torch.__version__} has no state_dict._get_fqns ({e})"
else:
    if list(inspect.signature(_get_fqns).parameters)[:2] != ["model", "name"]:  # pragma: no cover
        FQNS_UNAVAILABLE = f"torch {torch.__version__}: _get_fqns no longer takes (model, name)"


def fqns_of(model: torch.nn.Module, name: str) -> set[str]:
    """The FQNs DCP gives the parameter or state-dict key `name` of `model` (one, except for
    an FSDP1 flat parameter)."""
    return set(_get_fqns(model, name))


# --- 6. DCP's stager, emptied after every stage before torch 2.13 -------------------------------
# DefaultStager copies a state dict through a StateDictStager: a deepcopy with a dispatch table
# of copiers per type and a cache of staging buffers (pinned, on CUDA) per source storage. On
# torch 2.11 and 2.12 DefaultStager._stage ends by closing that StateDictStager, which clears
# the cache and the dispatch table too: the second stage finds no copier for a dict and fails
# (KeyError: <class 'type'>, or a RecursionError), so every async save after the first would
# fail. 2.13 leaves both alone until the stager's own close. `keep_stager_usable` makes the
# per-stage close of one stager (ours, never the user's) clear only the cache, as the older
# torch meant it to: each stage then allocates its buffers anew, as it did there.
def _stager_closes_after_stage() -> bool:
    try:
        return "_state_dict_stager.close()" in inspect.getsource(DefaultStager._stage)
    except (OSError, TypeError):
        # no source: decided by the release, as measured; one that cannot be read is mended,
        # which is harmless where it is not needed
        got = release(str(torch.__version__))
        return got is None or got < (2, 13, 0)


STAGER_CLOSES_AFTER_STAGE = _stager_closes_after_stage()
if STAGER_CLOSES_AFTER_STAGE:
    require_self_attrs(
        DefaultStager, ("_state_dict_stager",), feature="the async save's stager on this torch"
    )


def keep_stager_usable(stager: DefaultStager) -> DefaultStager:
    """`stager`, able to stage more than once on every tested torch (6. above)."""
    if STAGER_CLOSES_AFTER_STAGE:
        inner = stager._state_dict_stager
        cache = getattr(inner, "_cached_storage_mapping", None)
        if cache is None:  # pragma: no cover - depends on the torch release
            raise _missing("StateDictStager._cached_storage_mapping", "the stager is not mended")
        inner.close = cache.clear  # type: ignore[method-assign]
    return stager
