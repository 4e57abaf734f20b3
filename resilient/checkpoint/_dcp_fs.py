"""DCP's FileSystem interface over our Storage, and a view that serves verified bytes.

- `StorageFileSystem`: remote checkpoints go through our Storage (its retry policy, chunked
  concurrent uploads, ranged reads) instead of fsspec streams opened by DCP itself.
- `VerifiedBytesFileSystem`: wraps any of DCP's file systems; files handed to it as verified
  bytes are read from memory, everything else from the wrapped one. This is how a load
  reads each verified byte once (resilient/checkpoint/_dcp_read.py).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from resilient.storage import Buffer, Storage
from resilient.storage.transfer import MemoryReader

__all__ = ["StorageFileSystem", "VerifiedBytesFileSystem"]


class StorageFileSystem:
    """DCP's FileSystem interface over a remote Storage: every request goes through its policy.

    DCP's own FsspecWriter/Reader would call fsspec directly (s3fs's retry loop, not ours; a
    streaming upload that sends parts one at a time; a second filesystem built from the URL
    alone, which loses the storage options). Paths here are relative to the Storage root.
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


class VerifiedBytesFileSystem:
    """A DCP FileSystem whose reads of the files in `verified` come from those bytes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.verified: dict[str, Buffer] = {}
        """file name (no directory) -> its whole content, already checked against the
        manifest."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        data = self.verified.get(os.path.basename(os.fspath(path))) if "r" in mode else None
        if data is None:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        reader = MemoryReader(data)
        try:
            yield reader
        finally:
            reader.close()
