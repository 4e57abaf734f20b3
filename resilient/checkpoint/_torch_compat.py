"""Every private torch name the checkpoint subsystem relies on, checked once at import.

torch.distributed.checkpoint (DCP) has no public hook for some of what we do: storing a
value the way its load planner does, finding a reader's `.metadata`, knowing which file and
byte range a read item comes from, skipping torch.save's per-record zip CRC in our own
writer threads, loading into a fresh optimizer without the zero-gradient step that
set_optimizer_state_dict runs first, and reading a tensor record's bytes where they lie (the
layout of a torch.save archive). Each is taken here and nowhere else, and checked when
this module is imported: if a torch release renames or removes one, importing resilient
fails at once with an error naming the torch version and the feature, never later with a
silent default. Two exceptions, 6. and 7. below: what only makes a save or a load cheaper
turns itself off when it no longer holds, and DCP's public path is taken instead.

Tested with torch 2.13.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import struct
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any, NamedTuple, cast

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from resilient._torch_check import TorchCompatError, missing
from resilient._transfer import MemoryReader

__all__ = [
    "FQNS_UNAVAILABLE",
    "RecordSpan",
    "fqns_of",
    "metadata_path",
    "no_init_step",
    "no_zip_crc32_in_this_thread",
    "planner_store",
    "read_span",
    "tensor_in_record",
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


# --- 7. a tensor record's bytes where they lie --------------------------------------------------
# DCP writes each tensor as one torch.save archive inside the rank's file, and reads it back
# with torch.load: a copy into a fresh tensor (whose pages fault in on first touch), then a
# second copy into the destination. A torch.save archive is an uncompressed zip file with one
# record per storage, `<archive>/data/<key>`, holding the storage's raw bytes. When the bytes
# are in memory already (a verified load keeps them), a tensor can view them where they lie
# and the destination is filled in one copy. torch.load still reads the pickle, with
# map_location="meta" (no data read) and weights_only (no code run), for dtype, shape and
# strides; Python's zipfile finds the record. Whatever does not fit that picture (another
# layout, several storages, compression, a foreign byte order, a view past the record) gives
# None, and the item goes through torch.load as before. Checked at import with a round trip;
# a torch whose archives no longer fit turns this off (IN_PLACE_UNAVAILABLE says why).
IN_PLACE_UNAVAILABLE: str | None = None
_DATA_RECORD = re.compile(r"[^/]+/data/[^/]+")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra length


def tensor_in_record(buffer: Any, offset: int, length: int) -> torch.Tensor | None:
    """A tensor viewing the torch.save archive at `buffer[offset:offset + length]` in place
    (the archive's one tensor, as torch.load would return it), or None when it does not
    have the plain layout described above. Read it only while `buffer` is alive."""
    if IN_PLACE_UNAVAILABLE is not None:
        return None
    record = memoryview(buffer).cast("B")[offset : offset + length]
    try:
        stream = cast(IO[bytes], MemoryReader(record))
        meta = torch.load(stream, map_location="meta", weights_only=True)
        if type(meta) is not torch.Tensor or meta.layout != torch.strided:
            return None
        with zipfile.ZipFile(MemoryReader(record)) as archive:
            entries = archive.infolist()
        data = [e for e in entries if _DATA_RECORD.fullmatch(e.filename)]
        order = [e for e in entries if e.filename.endswith("/byteorder")]
        nbytes = meta.untyped_storage().nbytes()
        if len(data) != 1 or data[0].file_size != nbytes or nbytes == 0:
            return None
        byteorder = bytes(_stored(record, order[0])).decode() if order else "little"
        start = _data_start(record, data[0])
        if start is None or byteorder != sys.byteorder:
            return None
        with warnings.catch_warnings():  # read only: the destination gets a copy
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset + start)
        typed = raw.view(meta.dtype)
        return typed.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    except Exception:  # a fast path only: torch.load on DCP's own path reads
        return None  # the record again and says what is wrong with it, if anything


def _data_start(record: memoryview, entry: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed zip entry's bytes start in `record`; None if it is not one."""
    head = entry.header_offset
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(record, head)
    start = head + _LOCAL_HEADER.size + name_len + extra_len
    if (
        signature != b"PK\x03\x04"
        or entry.compress_type != zipfile.ZIP_STORED
        or start + entry.file_size > len(record)
    ):
        return None
    return start


def _stored(record: memoryview, entry: zipfile.ZipInfo) -> memoryview:
    """An uncompressed zip entry's bytes, read past zipfile's CRC check: our writer threads
    leave torch.save's CRC at 0 (4. above). ValueError when the entry is not plain."""
    start = _data_start(record, entry)
    if start is None:
        raise ValueError(f"{entry.filename}: not a stored zip entry")
    return record[start : start + entry.file_size]


def _check_in_place() -> str | None:
    expected = torch.arange(24, dtype=torch.float64).reshape(4, 6)[1:, 2:]
    for zip_crc in (True, False):  # as a user's torch.save writes it, and as our writer does
        stream = io.BytesIO()
        stream.write(b"x" * 7)  # DCP's records start anywhere in the file
        with contextlib.nullcontext() if zip_crc else no_zip_crc32_in_this_thread():
            torch.save(expected, stream)
        got = tensor_in_record(stream.getbuffer(), 7, stream.tell() - 7)
        if got is None or got.dtype != expected.dtype or not torch.equal(got, expected):
            return f"torch {torch.__version__}: a torch.save archive no longer has the layout read"
    return None


IN_PLACE_UNAVAILABLE = _check_in_place()
