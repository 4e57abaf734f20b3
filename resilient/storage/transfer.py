"""Chunked transfers for remote storage: an upload stream, a block-cached reader and a
whole-file read into memory.

Both move a file as parts of a few MiB, each part one request under the storage's retry
policy, several at a time. A transient error costs one part, not the whole file, and the
memory held stays bounded by concurrency x part size whatever the file size.

Knows nothing about torch or S3: the requests themselves come from a `PartSink` (writes) or
a fetch function (reads) that Storage builds.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from resilient.log import get_logger

__all__ = ["BlockReader", "MemoryReader", "PartSink", "UploadStream", "read_whole"]

MIN_PART = 5 << 20
"""S3's smallest part (every part but the last)."""
MAX_PART = 5 << 30
"""S3's largest part."""
MAX_PUT = 5 << 30
"""S3's largest single PUT."""
GROW_EVERY = 1000
"""The part size doubles every this many parts: S3 allows 10,000 parts per object, and the
size of a stream is not known in advance (8 MiB parts would stop at 78 GiB, this at ~8 TiB)."""


class PartSink(Protocol):
    """The requests an UploadStream makes; each method is one retried storage call."""

    multipart: bool
    """False: the stream buffers the whole file and calls `put` once."""

    def put(self, data: bytes) -> None: ...
    def start(self) -> str: ...
    def part(self, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]: ...
    def complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None: ...
    def abort(self, upload_id: str) -> None: ...


class UploadStream:
    """A write-only stream that uploads as it goes; the object appears only on `close()`.

    Below two parts the file is a single PUT at close (s3fs's threshold: a multipart upload
    costs two more requests and a server-side assembly). Beyond it, a multipart upload starts
    and full parts are uploaded in a pool of `concurrency` threads while the writer goes on;
    the writer blocks when that many are in flight. `close()` uploads the rest and completes
    the upload; `abort()` (or an error) drops it, and nothing becomes visible.

    Deliberately not an io.IOBase: those close themselves when garbage collected, which here
    would publish a partial file.
    """

    def __init__(self, sink: PartSink, *, part_size: int, concurrency: int, name: str) -> None:
        if sink.multipart and part_size < MIN_PART:
            raise ValueError(f"part_size must be >= {MIN_PART} bytes, got {part_size}")
        self._sink = sink
        self._part_size = part_size
        self._concurrency = max(1, concurrency)
        self._name = name
        self._buf = bytearray()
        self._held: bytes | bytearray | None = None  # the first full part, until a second
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._inflight: deque[Future[dict[str, Any]]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._done = False

    # the file protocol DCP and torch.save use ------------------------------------------------
    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing to do: parts leave when full, the rest on close()."""

    @property
    def closed(self) -> bool:
        return self._done

    def tell(self) -> int:
        return self._pos

    def write(self, b: Any) -> int:
        if self._done:
            raise ValueError(f"write to a closed upload of {self._name}")
        mv = memoryview(b).cast("B")
        n = len(mv)
        self._pos += n
        if not self._sink.multipart:
            self._buf += mv
            return n
        i = 0
        while i < n:
            size = self._next_part_size()
            take = min(size - len(self._buf), n - i)
            if not self._buf and take == size:
                self._ship(bytes(mv[i : i + take]))  # a whole part: one copy, off the caller's
            else:
                self._buf += mv[i : i + take]
                if len(self._buf) == size:
                    self._ship(self._buf)  # handed over as is: the next part gets a new buffer
                    self._buf = bytearray()
            i += take
        return n

    def close(self) -> None:
        """Upload what is left and make the object visible. Raises if any part failed."""
        if self._done:
            return
        try:
            if self._upload_id is None and (
                self._held is None or len(self._held) + len(self._buf) <= MAX_PUT
            ):
                self._sink.put(bytes(self._held or b"") + bytes(self._buf))
                self._held = None
            else:
                if self._buf:
                    self._ship(self._buf)
                while self._inflight:
                    self._parts.append(self._inflight.popleft().result())
                assert self._upload_id is not None  # _ship started it
                self._sink.complete(self._upload_id, self._parts)
            self._buf = bytearray()
            self._done = True
            self._shutdown()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the upload: cancel parts not started, wait for running ones, abort it."""
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        self._held = None
        for fut in self._inflight:
            fut.cancel()
        for fut in self._inflight:
            if not fut.cancelled():
                fut.exception()  # wait; the error, if any, was raised to the writer already
        self._inflight.clear()
        self._shutdown()
        if self._upload_id is not None:
            try:
                self._sink.abort(self._upload_id)
            except Exception as e:  # best effort: a bucket lifecycle rule cleans leftovers
                get_logger().warning(
                    "storage.abort_failed", file=self._name, error=f"{type(e).__name__}: {e}"
                )

    # internals ---------------------------------------------------------------------------
    def _next_part_size(self) -> int:
        shipped = len(self._parts) + len(self._inflight)
        return min(MAX_PART, self._part_size << (shipped // GROW_EVERY))

    def _ship(self, data: bytes | bytearray) -> None:
        if self._upload_id is None and self._held is None:
            self._held = data  # a single PUT at close, unless a second part comes
            return
        if self._upload_id is None:
            self._upload_id = self._sink.start()
            self._pool = ThreadPoolExecutor(
                max_workers=self._concurrency, thread_name_prefix="resilient-upload"
            )
        if self._held is not None:
            held, self._held = self._held, None
            self._submit(held)
        self._submit(data)

    def _submit(self, data: bytes | bytearray) -> None:
        assert self._pool is not None and self._upload_id is not None
        while len(self._inflight) >= self._concurrency:  # bound the memory held
            self._parts.append(self._inflight.popleft().result())
        number = len(self._parts) + len(self._inflight) + 1
        self._inflight.append(self._pool.submit(self._sink.part, self._upload_id, number, data))

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _fetch_exact(fetch: Callable[[int, int], bytes], start: int, end: int, name: str) -> bytes:
    """`fetch(start, end)`, or OSError when it returns another number of bytes."""
    data = fetch(start, end)
    if len(data) != end - start:
        raise OSError(
            f"{name}: read {len(data)} bytes at offset {start}, expected {end - start} "
            "(the object changed or was truncated while being read)"
        )
    return data


def read_whole(
    fetch: Callable[[int, int], bytes],
    size: int,
    *,
    part_size: int,
    concurrency: int,
    name: str,
    update: Callable[[Any, int], int],
) -> tuple[bytearray, int]:
    """(content, checksum) of a remote file of `size` bytes, read into memory in parts of
    `part_size` with `fetch(start, end)`, `concurrency` at a time; `update(data, value)`,
    a running checksum, runs over each part in order as it arrives."""
    buf = bytearray(size)
    view = memoryview(buf)
    spans = [(s, min(size, s + part_size)) for s in range(0, size, part_size)]

    def part(start: int, end: int) -> None:
        view[start:end] = _fetch_exact(fetch, start, end, name)

    value = 0
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="resilient-read") as pool:
        futures = [pool.submit(part, s, e) for s, e in spans]
        try:
            for (s, e), fut in zip(spans, futures, strict=True):
                fut.result()
                value = update(view[s:e], value)
        finally:
            for fut in futures:
                fut.cancel()
    return buf, value


class _SeekableReader(io.RawIOBase):
    """A read-only, seekable raw file over `_size` bytes; subclasses implement reading."""

    _pos: int = 0
    _size: int = 0
    _name: str = "a buffer"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos} in {self._name}")
        self._pos = pos
        return pos


class BlockReader(_SeekableReader):
    """A seekable read-only view of a remote file, fetched in aligned blocks.

    Blocks are fetched with `fetch(start, end)` (one retried ranged GET each), several at a
    time; a read also starts fetching the blocks after it, so a sequential reader keeps
    `concurrency` requests busy. An LRU keeps recent blocks, so the small backward seeks of
    torch.load stay in memory. Wrap it in io.BufferedReader for small reads.
    """

    def __init__(
        self,
        fetch: Callable[[int, int], bytes],
        size: int,
        *,
        block_size: int,
        concurrency: int,
        name: str,
    ) -> None:
        super().__init__()
        self._fetch = fetch
        self._size = size
        self._block = max(1, block_size)
        self._ahead = max(0, concurrency - 1)
        self._capacity = max(1, concurrency) + 2  # read-ahead plus the blocks just read
        self._name = name
        self._pos = 0
        self._blocks: OrderedDict[int, Future[bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, concurrency), thread_name_prefix="resilient-read"
        )

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = min(len(out), self._size - self._pos)
        if n <= 0:
            return 0
        first = self._pos // self._block
        last = (self._pos + n - 1) // self._block
        nblocks = (self._size + self._block - 1) // self._block
        wanted = range(first, min(nblocks, last + 1 + self._ahead))
        futures = {i: self._request(i) for i in wanted}
        done = 0
        for i in range(first, last + 1):
            data = futures[i].result()
            lo = max(self._pos, i * self._block) - i * self._block
            hi = min(self._pos + n, (i + 1) * self._block) - i * self._block
            out[done : done + hi - lo] = memoryview(data)[lo:hi]
            done += hi - lo
        self._pos += n
        self._evict(keep=set(wanted))
        return n

    def close(self) -> None:
        if not self.closed:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._blocks.clear()
        super().close()

    def _request(self, i: int) -> Future[bytes]:
        with self._lock:
            fut = self._blocks.get(i)
            if fut is None or (fut.done() and fut.exception() is not None):
                start = i * self._block
                end = min(self._size, start + self._block)
                fut = self._pool.submit(_fetch_exact, self._fetch, start, end, self._name)
                self._blocks[i] = fut
            self._blocks.move_to_end(i)
            return fut

    def _evict(self, keep: set[int]) -> None:
        with self._lock:
            for i in list(self._blocks):
                if len(self._blocks) <= self._capacity:
                    break
                if i not in keep and self._blocks[i].done():
                    del self._blocks[i]


class MemoryReader(_SeekableReader):
    """A seekable read-only stream over bytes already in memory, without copying them
    (io.BytesIO copies a bytearray)."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._size = len(self._view)
        self._pos = 0

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        n = len(self._view)
        end = n if size is None or size < 0 else min(n, self._pos + size)
        start, self._pos = self._pos, max(self._pos, end)
        return self._view[start:end].tobytes()

    def close(self) -> None:
        self._view.release()
        super().close()
