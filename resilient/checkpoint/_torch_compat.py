"""Every private torch name the checkpoint subsystem relies on, checked once at import.

torch.distributed.checkpoint (DCP) has no public hook for some of what we do: storing a
value the way its load planner does, finding a reader's `.metadata`, knowing which file and
byte range a read item comes from, skipping torch.save's per-record zip CRC in our own
writer threads, and loading into a fresh optimizer without the zero-gradient step that
set_optimizer_state_dict runs first. Each is taken here and nowhere else, and checked when
this module is imported: if a torch release renames or removes one, importing resilient
fails at once with an error naming the torch version and the feature, never later with a
silent default. One exception, 6. below: a name that only makes saves cheaper turns that
saving off when it is missing (logged), and DCP's public path is taken instead.

Tested with torch 2.13.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from resilient._torch_check import TorchCompatError, missing

__all__ = [
    "FQNS_UNAVAILABLE",
    "fqns_of",
    "metadata_path",
    "no_init_step",
    "no_zip_crc32_in_this_thread",
    "planner_store",
    "read_location",
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


def read_location(reader: FileSystemReader, storage_index: Any) -> tuple[str, int]:
    """(file name, bytes) that DCP reads for one ReadItem's `storage_index`, from the
    reader's storage_data (set by set_up_storage_reader)."""
    info = reader.storage_data[storage_index]
    return str(info.relative_path), int(info.length)


# --- 4. torch.save's zip CRC, off in our writer threads only ------------------------------------
# DCP writes every record with torch.save, whose zip writer computes a CRC-32 of every byte
# that torch.load never checks (torch's own set_crc32_options documents this). Our manifest
# already checksums each file, so in our writer threads that pass is pure cost. torch's switch
# is process-wide (torch.utils.serialization.config.save.compute_crc32): flipping it would
# also strip the CRC from a user's own torch.save running in another thread. Instead
# torch.serialization's lookup of the switch is answered per thread: False inside
# `no_zip_crc32_in_this_thread()`, torch's own setting everywhere else.
_ZIP_WRITER_INITS = (
    torch.serialization._open_zipfile_writer_buffer.__init__,
    torch.serialization._open_zipfile_writer_file.__init__,
)
if not callable(getattr(torch.serialization, "get_crc32_options", None)) or not all(
    "get_crc32_options" in f.__code__.co_names for f in _ZIP_WRITER_INITS
):  # pragma: no cover
    raise _missing(
        "torch.serialization.get_crc32_options, looked up by torch.save's zip writers",
        "torch.save no longer asks it",
    )

_local = threading.local()
_torch_get_crc32: Callable[[], bool] = torch.serialization.get_crc32_options
_install_lock = threading.Lock()


def _get_crc32_options() -> bool:
    if getattr(_local, "skip", False):
        return False
    return _torch_get_crc32()


_get_crc32_options.__doc__ = _torch_get_crc32.__doc__


@contextlib.contextmanager
def no_zip_crc32_in_this_thread() -> Iterator[None]:
    """torch.save in this thread writes zip records without their CRC-32 (0 in its place;
    torch.load reads them as always). Other threads keep torch's setting."""
    with _install_lock:
        if torch.serialization.get_crc32_options is not _get_crc32_options:
            torch.serialization.get_crc32_options = _get_crc32_options
    previous = getattr(_local, "skip", False)
    _local.skip = True
    try:
        yield
    finally:
        _local.skip = previous


# --- 5. set_optimizer_state_dict's step on a fresh optimizer ---------------------------------
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
def no_init_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, set_optimizer_state_dict loads into a fresh `optimizer` without stepping it
    first. The placeholder is gone after a load (the state is replaced) or taken out here."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or not params:
        yield
        return
    placeholder: dict[str, Any] = {}
    optimizer.state[params[0]] = placeholder
    try:
        yield
    finally:
        if optimizer.state.get(params[0]) is placeholder:  # the load did not happen
            del optimizer.state[params[0]]


# --- 6. the name DCP gives a model's parameter or state-dict key --------------------------------
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
