"""Our extensions of torch.distributed.checkpoint (DCP), kept in one place.

Why each exists:
- `make_writer` gives a writer that records (size, crc32) of every file DCP writes, computed
  inline as the bytes go by, so the manifest needs no second read of the checkpoint.
- `make_reader` and `SafeLoadPlanner`: stock DCP 2.13 reads `.metadata` with `pickle.load` and
  non-tensor values with `torch.load(weights_only=False)`; both run code from the checkpoint.
  We restrict both to plain data, so loading an untrusted checkpoint cannot execute code.
- `_StorageFileSystem`: remote checkpoints go through our Storage (its retry policy, chunked
  concurrent uploads, ranged reads) instead of fsspec streams opened by DCP.

It touches `FileSystemWriter.fs`, an attribute rather than a documented hook, and a private
module: this is the one place where we lean on DCP's internals.
"""

from __future__ import annotations

import io
import os
import pickle
import posixpath
import threading
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

# Private module, used only here: set_element is how DefaultLoadPlanner.load_bytes stores a
# value (we mirror that method).
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from resilient.errors import CheckpointCorruptError
from resilient.storage import Storage

# Writes at least this large are hashed on a helper thread while the write runs.
_OVERLAP_MIN_BYTES = 1 << 20

__all__ = ["SafeLoadPlanner", "make_reader", "make_writer", "read_metadata_safely"]


class _HashingStream:
    """Pass-through writer that keeps a running crc32 and byte count.

    With a `pool`, large writes are hashed on a helper thread while `write()` runs: both
    release the GIL, and on a local disk write() spends most of its time off the CPU, so
    the checksum costs almost no wall time. The helper is joined before write() returns,
    because the buffer belongs to the caller.
    """

    def __init__(self, raw: Any, pool: ThreadPoolExecutor | None = None) -> None:
        self._raw = raw
        self._pool = pool
        self.crc = 0
        self.size = 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if self._pool is None or len(mv) < _OVERLAP_MIN_BYTES:
            n = self._raw.write(b)
            n = len(mv) if n is None else n
            self.crc = zlib.crc32(mv[:n], self.crc)
        else:
            pending = self._pool.submit(zlib.crc32, mv, self.crc)
            try:
                n = self._raw.write(b)
            finally:
                whole = pending.result()
            n = len(mv) if n is None else n
            self.crc = whole if n == len(mv) else zlib.crc32(mv[:n], self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)


class _HashingFileSystem:
    """Wraps DCP's FileSystem so every stream opened for writing is hashed."""

    def __init__(self, inner: Any, sink: dict[str, tuple[int, int]], lock: threading.Lock) -> None:
        self._inner = inner
        self._sink = sink
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-crc")
            try:
                stream = _HashingStream(raw, pool)
                yield stream
            finally:
                pool.shutdown(wait=True)
        name = os.path.basename(os.fspath(path))
        with self._lock:
            self._sink[name] = (stream.crc, stream.size)


class _LocalWriter(FileSystemWriter):
    """FileSystemWriter that exposes `file_checksums`: {file name: (crc32, size)} for this rank."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.file_checksums: dict[str, tuple[int, int]] = {}
        self.fs = _HashingFileSystem(self.fs, self.file_checksums, threading.Lock())  # type: ignore[assignment]


class _StorageFileSystem:
    """DCP's FileSystem interface over a remote Storage: every request goes through its policy.

    DCP's own FsspecWriter/Reader would call fsspec directly (s3fs's retry loop, not ours; a
    streaming upload that sends parts one at a time; a second filesystem built from the URL
    alone, docs/internals.md#g-fsspec-writer-options). Paths here are relative to the Storage root.
    """

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        rel = os.fspath(path)
        if "w" in mode:
            stream = self._storage.open_write(rel)
            try:
                yield stream
            except BaseException:
                stream.abort()  # nothing becomes visible
                raise
            stream.close()
        else:
            with self._storage.open_read(rel) as f:
                yield f

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # DCP renames .metadata.tmp to .metadata; on S3 a copy and a delete, not atomic. The
        # commit marker is our manifest, written after this, so nothing relies on it.
        self._storage.move(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self._storage.makedirs(os.fspath(path))

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self._storage.is_file(os.fspath(path))  # DCP asks only about .metadata files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self._storage.remove_file(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return self._storage.list_files(os.fspath(path))


class _RemoteWriter(FileSystemWriter):
    """FileSystemWriter on a remote Storage (relative paths), with `file_checksums`."""

    def __init__(self, storage: Storage, rel: str, *, thread_count: int) -> None:
        # sync_files off: on a stream without fileno() DCP would fall back to a system-wide
        # os.sync() (pytorch#142396); a remote object is durable once its upload completes.
        super().__init__(rel, sync_files=False, thread_count=thread_count)
        self.path = rel
        self.file_checksums: dict[str, tuple[int, int]] = {}
        self.fs = _HashingFileSystem(  # type: ignore[assignment]
            _StorageFileSystem(storage), self.file_checksums, threading.Lock()
        )


def make_writer(storage: Storage, rel: str, *, thread_count: int) -> Any:
    """A DCP storage writer for directory `rel` of `storage`, recording file checksums.

    Locally DCP writes and fsyncs the files itself. Remotely every request goes through the
    Storage and its retry policy, and each file appears only once completely uploaded.
    """
    if storage.is_local:
        return _LocalWriter(storage.path(rel), sync_files=True, thread_count=thread_count)
    return _RemoteWriter(storage, rel, thread_count=thread_count)


# Globals a DCP .metadata pickle may name; anything else is refused.
_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Protocol 4 resolves a dotted name attribute by attribute, so "os.system" inside an
        # allowed module would reach os.system: only plain names of classes defined there pass.
        if module in _ALLOWED_MODULES and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in {
            "strided",
            "sparse_coo",
            "contiguous_format",
            "preserve_format",
            "channels_last",
        }:
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names a forbidden global {module}.{name}"
        )


def read_metadata_safely(stream: io.BufferedIOBase | Any) -> Metadata:
    md = _RestrictedUnpickler(stream).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"checkpoint metadata is a {type(md).__name__}, not Metadata")
    return md


class _SafeMetadata:
    """Reads `.metadata` with a restricted unpickler (mixed into DCP's readers)."""

    fs: Any
    load_id: Any
    _get_metadata_path: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                md = read_metadata_safely(f)
            except (pickle.UnpicklingError, EOFError) as e:
                raise CheckpointCorruptError(f"{path}: refused to load ({e})") from e
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


class _LocalReader(_SafeMetadata, FileSystemReader):
    pass


class _RemoteReader(_SafeMetadata, FileSystemReader):
    def __init__(self, storage: Storage, rel: str) -> None:
        super().__init__(rel)
        self.path = rel
        self.fs = _StorageFileSystem(storage)


def make_reader(storage: Storage, rel: str) -> Any:
    """A DCP storage reader for directory `rel` of `storage` that cannot execute pickled code."""
    if storage.is_local:
        return _LocalReader(storage.path(rel))
    return _RemoteReader(storage, rel)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
