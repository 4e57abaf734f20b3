"""What differs between storage systems, as one type: a Backend per kind of filesystem.

Storage (resilient.storage.core) does everything through fsspec and its retry policy; the few
requests that differ per system go through its Backend:
- `FsspecBackend`: any fsspec filesystem, local directories included (generic calls, whole
  file uploads in one call);
- `resilient.storage.s3.S3Backend`: s3:// through s3fs (single HEAD and CopyObject requests,
  multipart uploads, retry loops below ours reduced to one attempt, error hints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from resilient.storage import s3
from resilient.storage.transfer import PartSink

__all__ = ["Backend", "FsspecBackend", "Storage", "backend_for"]

T = TypeVar("T")


class Storage(Protocol):
    """What a backend uses of the Storage that calls it (storage/core.py): kept to a protocol
    so that backends need not import the storage they serve."""

    url: str
    fs: Any

    def path(self, *parts: str) -> str: ...

    def call(self, what: str, fn: Callable[[], T]) -> T: ...


# Object stores have no directories: makedirs would create a bucket (s3fs, gcsfs) or nothing.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci"}


class Backend(Protocol):
    """The requests of one kind of filesystem that Storage does not make generically."""

    def prepare_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """fsspec options with this backend's defaults filled in (explicit values win)."""

    def tune(self, fs: Any) -> None:
        """Adjust the filesystem object fsspec built (once, after it is built)."""

    def secrets(self, options: dict[str, Any]) -> list[str]:
        """Secret values in `options`, to redact from every message."""

    def is_file(self, storage: Storage, path: str) -> bool:
        """Whether file `path` (absolute, no protocol) exists; one request where possible."""

    def copy(self, storage: Storage, src: str, dst: str) -> None:
        """Copy file `src` to `dst` (absolute paths) inside the filesystem."""

    def sink(self, storage: Storage, rel: str) -> PartSink:
        """The requests that upload file `rel` (storage/transfer.py's UploadStream uses them)."""

    def explain(self, storage: Storage, exc: BaseException) -> str | None:
        """How to fix the configuration problem behind `exc`; None when not recognised."""


def protocols_of(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def is_local(fs: Any) -> bool:
    """Files on this machine's filesystem (DCP writes and fsyncs them itself)."""
    return bool({"file", "local"} & set(protocols_of(fs)))


def is_object_store(fs: Any) -> bool:
    """No directories: nothing to create before writing a file."""
    return bool(_OBJECT_STORES & set(protocols_of(fs)))


class FsspecBackend:
    """Any fsspec filesystem through its generic calls."""

    def prepare_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return dict(options)

    def tune(self, fs: Any) -> None:
        pass

    def secrets(self, options: dict[str, Any]) -> list[str]:
        return s3.secrets_of(options)  # the usual option names, whatever the system

    def is_file(self, storage: Storage, path: str) -> bool:
        return bool(storage.fs.isfile(path))

    def copy(self, storage: Storage, src: str, dst: str) -> None:
        storage.fs.cp_file(src, dst)

    def sink(self, storage: Storage, rel: str) -> PartSink:
        return _PipeSink(storage, rel)

    def explain(self, storage: Storage, exc: BaseException) -> str | None:
        return None


class _PipeSink:
    """Uploads for fsspec filesystems without multipart: the whole file in one call."""

    multipart = False

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage = storage
        self._rel = rel

    def put(self, data: bytes) -> None:
        path = self._storage.path(self._rel)
        self._storage.call(f"put {self._rel}", lambda: self._storage.fs.pipe_file(path, data))

    # never called: multipart is False
    def start(self) -> str:
        raise NotImplementedError

    def part(self, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]:
        raise NotImplementedError

    def complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def abort(self, upload_id: str) -> None:
        raise NotImplementedError


def backend_for(url: str) -> Backend:
    """The backend of a location URL (a plain path is a local directory)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in s3.PROTOCOLS:
        return s3.S3Backend()
    return FsspecBackend()
