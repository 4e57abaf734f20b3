"""The DCP writer of our checkpoints: it checksums every file as DCP writes it.

`make_writer` gives a FileSystemWriter that records (checksum, size) of every file, computed
once as the bytes go by (resilient.checksum: CRC-32C), so the manifest needs no second read
of the checkpoint. In the threads that write our files, torch.save's own per-record zip
CRC-32 is skipped (resilient/checkpoint/_torch_compat.py): torch.load never checks it and
our checksum covers every byte, so it was a second CPU pass over the same bytes. The files
are otherwise exactly what DCP's FileSystemWriter writes: stock DCP reads them.

It replaces `FileSystemWriter.fs`, an attribute rather than a documented hook.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from resilient.checkpoint._dcp_fs import StorageFileSystem
from resilient.checkpoint._torch_compat import no_zip_crc32_in_this_thread
from resilient.checksum import DEFAULT, updater
from resilient.storage import Storage

# Writes at least this large are hashed on a helper thread while the write runs.
_OVERLAP_MIN_BYTES = 1 << 20

__all__ = ["make_writer"]


class _HashingStream:
    """Pass-through writer that keeps a running checksum and byte count.

    With a `pool`, large writes are hashed on a helper thread while `write()` runs: both
    release the GIL, and on a local disk write() spends most of its time off the CPU, so
    the checksum costs almost no wall time. The helper is joined before write() returns,
    because the buffer belongs to the caller.
    """

    def __init__(
        self,
        raw: Any,
        pool: ThreadPoolExecutor | None = None,
        update: Callable[[Any, int], int] | None = None,
    ) -> None:
        self._raw = raw
        self._pool = pool
        self._update = update or updater(DEFAULT)
        self.crc = 0
        self.size = 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if self._pool is None or len(mv) < _OVERLAP_MIN_BYTES:
            n = self._raw.write(b)
            n = len(mv) if n is None else n
            self.crc = self._update(mv[:n], self.crc)
        else:
            pending = self._pool.submit(self._update, mv, self.crc)
            try:
                n = self._raw.write(b)
            finally:
                whole = pending.result()
            n = len(mv) if n is None else n
            self.crc = whole if n == len(mv) else self._update(mv[:n], self.crc)
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
    """Wraps DCP's FileSystem so every stream opened for writing is hashed, and torch.save
    skips its zip CRC in the thread writing it (our checksum covers those bytes)."""

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
                with no_zip_crc32_in_this_thread():
                    yield stream
            finally:
                pool.shutdown(wait=True)
        name = os.path.basename(os.fspath(path))
        with self._lock:
            self._sink[name] = (stream.crc, stream.size)


class _LocalWriter(FileSystemWriter):
    """FileSystemWriter that exposes `file_checksums`: {file name: (checksum, size)} for this
    rank (resilient.checksum.DEFAULT)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.file_checksums: dict[str, tuple[int, int]] = {}
        self.fs = _HashingFileSystem(self.fs, self.file_checksums, threading.Lock())  # type: ignore[assignment]


class _RemoteWriter(FileSystemWriter):
    """FileSystemWriter on a remote Storage (relative paths), with `file_checksums`."""

    def __init__(self, storage: Storage, rel: str, *, thread_count: int) -> None:
        # sync_files off: on a stream without fileno() DCP would fall back to a system-wide
        # os.sync() (pytorch#142396); a remote object is durable once its upload completes.
        super().__init__(rel, sync_files=False, thread_count=thread_count)
        self.path = rel
        self.file_checksums: dict[str, tuple[int, int]] = {}
        self.fs = _HashingFileSystem(  # type: ignore[assignment]
            StorageFileSystem(storage), self.file_checksums, threading.Lock()
        )


def make_writer(storage: Storage, rel: str, *, thread_count: int) -> Any:
    """A DCP storage writer for directory `rel` of `storage`, recording file checksums.

    Locally DCP writes and fsyncs the files itself. Remotely every request goes through the
    Storage and its retry policy, and each file appears only once completely uploaded.
    """
    if storage.is_local:
        return _LocalWriter(storage.path(rel), sync_files=True, thread_count=thread_count)
    return _RemoteWriter(storage, rel, thread_count=thread_count)
