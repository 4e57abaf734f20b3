"""torch.save's archive format, where resilient relies on it: checked once at import.

DCP writes every tensor as one torch.save archive inside a rank's file. Two things here lean on
how torch.save writes it, which torch does not document as an API: skipping the zip CRC-32 of
every record in our own writer threads (1.), and reading a tensor record's bytes where they
lie (2.). Both only make a save or a load cheaper: a torch whose archives no longer fit turns
the fast path off and says why, and DCP's own torch.save and torch.load are used instead,
except for 1., whose lookup must be there (a missing one fails at import, naming the torch
version and the feature, as every compat module does: resilient/_torch_check.py).

Checked on torch 2.11.0, 2.12.0, 2.13.0, 2.14.1, 2.15.0 (the tested range,
resilient/_torch_check.py): every check below passes on each, with no fast path turned off.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
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

from resilient._torch_check import TorchCompatError, missing
from resilient.storage.transfer import MemoryReader

__all__ = [
    "FAST_HEADER_UNAVAILABLE",
    "IN_PLACE_UNAVAILABLE",
    "no_zip_crc32_in_this_thread",
    "tensor_in_record",
]


def _missing(what: str, why: str) -> TorchCompatError:
    return missing(f"{what} ({why})", "resilient's checkpoints")


# --- 1. torch.save's zip CRC, off in our writer threads only ------------------------------------
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


# --- 2. a tensor record's bytes where they lie --------------------------------------------------
# DCP writes each tensor as one torch.save archive inside the rank's file, and reads it back
# with torch.load: a copy into a fresh tensor (whose pages fault in on first touch), then a
# second copy into the destination. A torch.save archive is an uncompressed zip file with one
# record per storage, `<archive>/data/<key>`, holding the storage's raw bytes. When the bytes
# are in memory already (a verified load keeps them), a tensor can view them where they lie
# and the destination is filled in one copy. Python's zipfile finds the records. dtype, shape
# and strides come from the archive's pickle, read by `_TensorPickle`: an unpickler that
# knows only what torch.save writes for one plain tensor (_rebuild_tensor_v2 over one typed
# storage) and refuses everything else, so no code runs. It takes about 0.03 ms a record,
# where torch.load(map_location="meta", weights_only=True) took 0.24 ms: at 4 GiB of state,
# 510 records a rank, that was 0.1-0.3 s of every load. A pickle it refuses goes to that
# torch.load, as before. Whatever does not fit the picture (another layout, several
# storages, compression, a foreign byte order, a view past the record) gives None, and the
# item goes through DCP's own torch.load. Checked at import with round trips against
# torch.load: a torch whose archives no longer fit turns the unpickler off
# (FAST_HEADER_UNAVAILABLE) or the whole path (IN_PLACE_UNAVAILABLE), and says why.
IN_PLACE_UNAVAILABLE: str | None = None
FAST_HEADER_UNAVAILABLE: str | None = None
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
        with zipfile.ZipFile(MemoryReader(record)) as archive:
            entries = archive.infolist()
        layout = _layout(record, entries)
        if layout is None:
            return None
        data = [e for e in entries if _DATA_RECORD.fullmatch(e.filename)]
        order = [e for e in entries if e.filename.endswith("/byteorder")]
        nbytes = layout.storage_numel * layout.dtype.itemsize
        if len(data) != 1 or data[0].file_size != nbytes or nbytes == 0:
            return None
        byteorder = bytes(_stored(record, order[0])).decode() if order else "little"
        start = _data_start(record, data[0])
        if start is None or byteorder != sys.byteorder:
            return None
        with warnings.catch_warnings():  # read only: the destination gets a copy
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset + start)
        typed = raw.view(layout.dtype)
        return typed.as_strided(layout.shape, layout.stride, layout.storage_offset)
    except Exception:  # a fast path only: torch.load on DCP's own path reads
        return None  # the record again and says what is wrong with it, if anything


class _Layout(NamedTuple):
    """What a torch.save archive of one plain tensor says of it, beside its bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int


def _layout(record: memoryview, entries: list[zipfile.ZipInfo]) -> _Layout | None:
    """The tensor's layout from the archive's pickle: `_TensorPickle` when it knows the
    pickle, torch.load's meta tensor otherwise; None for anything but one strided tensor."""
    if FAST_HEADER_UNAVAILABLE is None:
        with contextlib.suppress(Exception):  # not one we know: torch.load decides
            return _pickled_layout(record, entries)
    meta = torch.load(cast(IO[bytes], MemoryReader(record)), map_location="meta", weights_only=True)
    if type(meta) is not torch.Tensor or meta.layout != torch.strided:
        return None
    return _Layout(
        meta.dtype,
        tuple(meta.shape),
        meta.stride(),
        int(meta.storage_offset()),
        meta.untyped_storage().nbytes() // meta.element_size(),
    )


def _pickled_layout(record: memoryview, entries: list[zipfile.ZipInfo]) -> _Layout:
    """The layout `_TensorPickle` reads from the archive's one data.pkl; raises when there is
    not exactly one, or it is not a pickle of one plain tensor."""
    (pickled,) = [e for e in entries if e.filename.endswith("/data.pkl")]
    return _TensorPickle(io.BytesIO(_stored(record, pickled))).layout()


def _storage_dtypes() -> dict[str, torch.dtype]:
    """torch's typed storage class names (FloatStorage, ...), as torch.save names a tensor's
    storage in its pickle, and their dtypes; quantized ones left out (not plain tensors)."""
    found: dict[str, torch.dtype] = {}
    quantized = {
        getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    }
    with warnings.catch_warnings(), contextlib.suppress(Exception):  # checked at import below
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, and says so on use
        for name in dir(torch):
            cls = getattr(torch, name)
            if (
                name.endswith("Storage")
                and isinstance(cls, type)
                and issubclass(cls, torch.TypedStorage)
                and cls is not torch.TypedStorage
                and name != "Storage"
            ):
                dtype = cls.dtype
                if isinstance(dtype, torch.dtype) and dtype not in quantized:
                    found[name] = dtype
    return found


_STORAGE_DTYPES = _storage_dtypes()


class _StorageRef(NamedTuple):
    dtype: torch.dtype
    numel: int


class _TensorPickle(pickle.Unpickler):
    """Reads the pickle torch.save writes for one plain tensor, `_rebuild_tensor_v2(storage,
    offset, size, stride, requires_grad, hooks)` with the storage as a persistent id, into a
    _Layout. Any other global or shape of pickle raises UnpicklingError: nothing else is
    built, and no code from the archive runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> _StorageRef:
        tag, dtype, _key, _location, numel = pid
        if tag != "storage" or not isinstance(dtype, torch.dtype) or type(numel) is not int:
            raise pickle.UnpicklingError(f"not a tensor storage: {pid!r}")
        return _StorageRef(dtype, numel)

    def layout(self) -> _Layout:
        got = self.load()
        if not isinstance(got, _Layout):
            raise pickle.UnpicklingError(f"not one tensor: {type(got).__name__}")
        return got


def _rebuilt(
    storage: _StorageRef,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    hooks: Any,
    metadata: Any = None,
) -> _Layout:
    if not isinstance(storage, _StorageRef) or hooks or metadata:
        raise pickle.UnpicklingError("not a plain tensor")
    return _Layout(storage.dtype, tuple(size), tuple(stride), storage_offset, storage.numel)


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
    leave torch.save's CRC at 0 (1. above). ValueError when the entry is not plain."""
    start = _data_start(record, entry)
    if start is None:
        raise ValueError(f"{entry.filename}: not a stored zip entry")
    return record[start : start + entry.file_size]


def _check_fast_header() -> str | None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    for t in (base[1:, 2:], base.t().to(torch.bfloat16), base > 3, torch.tensor(7)):
        stream = io.BytesIO()
        torch.save(t, stream)
        record = stream.getbuffer()
        try:
            with zipfile.ZipFile(MemoryReader(record)) as archive:
                got = _pickled_layout(record, archive.infolist())
        except Exception as e:
            return f"torch {torch.__version__}: torch.save's tensor pickle is not read ({e})"
        want = (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        if got[:4] != want or got.storage_numel * t.element_size() != t.untyped_storage().nbytes():
            return f"torch {torch.__version__}: torch.save's tensor pickle reads {got}, not {want}"
    return None


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


FAST_HEADER_UNAVAILABLE = _check_fast_header()
IN_PLACE_UNAVAILABLE = _check_in_place()
