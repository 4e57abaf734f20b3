"""Storage: a checkpoint root on any fsspec URL, every call under one retry policy.

A local directory by default, s3:// through s3fs. Knows nothing about torch. Every call that
touches storage goes through `RetryPolicy` (resilient.storage.retry), so transient errors are
retried with backoff inside a bounded time budget and permanent ones fail at once. What
differs per system goes through its Backend (resilient.storage.backends); for S3 the retry
loops of botocore and s3fs are reduced to a single attempt (resilient/storage/s3.py), so this policy
is the only one and its budget holds.

Remote files are written and read in parts (resilient/storage/transfer.py): each part is one retried
call, several run at a time, and a file appears only once its upload completes. Local files
are written durably and read as memory maps (resilient/storage/local.py).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import posixpath
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec

from resilient.errors import ConfigError, StorageError
from resilient.storage import s3
from resilient.storage.backends import backend_for, is_local, is_object_store
from resilient.storage.checksum import DEFAULT, checksum_of, updater
from resilient.storage.classify import is_explained, location_error
from resilient.storage.local import map_file, write_atomic
from resilient.storage.redact import hide_userinfo, redact, userinfo_secrets
from resilient.storage.retry import RetryPolicy
from resilient.storage.transfer import BlockReader, UploadStream, read_whole

__all__ = ["Buffer", "Storage"]

T = TypeVar("T")
Buffer = bytes | bytearray | mmap.mmap
"""Bytes in memory or mapped from a file."""
_PART = 16 << 20
"""Part size of uploads and block size of reads unless storage_options set
`default_block_size` (s3fs's own default, 50 MiB, holds 500 MiB per file in flight and starts
uploading late; 16 MiB measured as fast, see docs/benchmarks-history.md)."""


class Storage:
    """A checkpoint root on an fsspec filesystem; paths given to methods are relative to it.

    Remote options (endpoint, region, credentials) come from the usual places (AWS_* variables,
    ~/.aws/config and credentials, AWS_PROFILE) or from `storage_options`, which win. For S3,
    `max_concurrency` (parts in flight per file, default 10) and `default_block_size` (part
    and read block size, default 16 MiB here) are s3fs's own options and tune transfers too;
    a file being written or read holds about (max_concurrency + 2) x default_block_size.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        raw = os.fspath(url)
        if not raw:
            raise ConfigError("checkpoint location is empty: give a directory or an fsspec URL")
        self.url = hide_userinfo(raw)  # never show user:password@ from a URL
        self.retry = retry or RetryPolicy()
        self.backend = backend_for(raw)
        options = self.backend.prepare_options(dict(storage_options or {}))
        self._secrets = tuple(self.backend.secrets(options) + userinfo_secrets(raw))
        try:
            self.fs, root = fsspec.core.url_to_fs(raw, **options)
        except (ImportError, ValueError, TypeError) as e:
            raise ConfigError(
                f"cannot open checkpoint location {self.url!r}: {self.redact(str(e))}"
            ) from e
        self.backend.tune(self.fs)
        self.root = root.rstrip("/") or "/"
        self.is_local = is_local(self.fs)
        """Files on this machine: DCP writes them itself, and loads map them."""
        self.is_object_store = is_object_store(self.fs)
        if self.is_local:
            self.root = os.path.abspath(self.root)
        self.part_size = max(int(options.get("default_block_size") or _PART), 5 << 20)
        self.concurrency = max(1, int(getattr(self.fs, "max_concurrency", 10) or 10))
        self._deadline: float | None = None

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # ------------------------------------------------------------------ paths and policy
    def path(self, *parts: str) -> str:
        """The absolute path (no protocol) of `parts` below the root."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def url_of(self, *parts: str) -> str:
        """`parts` below the root as a URL with its protocol (s3://bucket/...)."""
        return str(self.fs.unstrip_protocol(self.path(*parts)))

    def redact(self, text: str) -> str:
        """`text` without any credential this storage knows of (environment or options)."""
        return redact(text, self._secrets)

    @contextlib.contextmanager
    def budget(self, seconds: float | None) -> Iterator[None]:
        """Calls inside stop retrying `seconds` from now (None: no deadline).

        Applies to every thread that uses this Storage meanwhile (DCP's writer threads, the
        upload pools): one save at a time per Storage, as the checkpoint manager does.
        """
        previous = self._deadline
        self._deadline = None if seconds is None else self.retry.clock() + seconds
        try:
            yield
        finally:
            self._deadline = previous

    def call(self, what: str, fn: Callable[[], T], *, cleanup: bool = False) -> T:
        """`fn` under the retry policy. A `cleanup` call (aborting an upload after a failure)
        is retried past the save's deadline: it keeps a failed save from leaving garbage.
        A configuration problem (what `explain` recognises: credentials, a missing bucket,
        ...) becomes a StorageError naming the fix; other errors are raised unchanged."""
        deadline = None if cleanup else self._deadline
        try:
            return self.retry.call(
                f"{what} at {self.url}", fn, deadline=deadline, redact=self.redact
            )
        except Exception as e:
            if is_explained(e) or self.backend.explain(self, e) is None:
                raise
            raise self.error(e, f"cannot be used: {what} failed") from e

    # ------------------------------------------------------------------ small calls
    def exists(self, rel: str) -> bool:
        return self.call(f"exists {rel}", lambda: self.fs.exists(self.path(rel)))

    def is_file(self, rel: str) -> bool:
        """Whether file `rel` exists (one HEAD on S3; `exists` also looks for a directory)."""
        return self.call(f"exists {rel}", lambda: self.backend.is_file(self, self.path(rel)))

    def list_dirs(self) -> list[str]:
        """Names of the directories directly under the root ([] when the root does not exist)."""

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.root, detail=True)
            except FileNotFoundError as e:
                if s3.error_code(e)[0] == "NoSuchBucket":  # an absent prefix is fine
                    raise self.error(e, "cannot be listed") from e
                return []
            return [
                posixpath.basename(e["name"].rstrip("/"))
                for e in entries
                if e.get("type") == "directory"
            ]

        return self.call("list", ls)

    def list_sizes(self, rel: str, *, missing_ok: bool = False) -> dict[str, int]:
        """{file name: size} of the files directly inside directory `rel`, in one listing.

        Raises FileNotFoundError when `rel` does not exist, unless `missing_ok` ({} then).
        """

        def ls() -> list[dict[str, Any]]:
            try:
                return list(self.fs.ls(self.path(rel), detail=True))
            except FileNotFoundError:
                if missing_ok:
                    return []
                raise

        entries = self.call(f"list {rel}", ls)
        return {
            posixpath.basename(e["name"]): int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    def list_files(self, rel: str) -> list[str]:
        """File names directly inside directory `rel`."""
        return list(self.list_sizes(rel))

    def size(self, rel: str) -> int:
        return int(self.call(f"size {rel}", lambda: self.fs.size(self.path(rel))))

    def read_bytes(self, rel: str) -> bytes:
        return self.call(f"read {rel}", lambda: self.fs.cat_file(self.path(rel)))

    def makedirs(self, rel: str = "") -> None:
        """Create directory `rel`; nothing on object stores, which have no directories (and
        where s3fs would otherwise create a missing bucket)."""
        if self.is_object_store:
            return
        self.call(f"mkdir {rel}", lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def remove_tree(self, rel: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(rel), recursive=True)

        self.call(f"remove {rel}", run)

    def remove_file(self, rel: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(rel))

        self.call(f"remove {rel}", run)

    def move(self, src: str, dst: str) -> None:
        """Move file `src` to `dst`. On object stores a copy then a delete: not atomic, so
        nothing may rely on it for a commit. Safe to retry after a partial success. On S3 a
        single CopyObject: files up to 5 GB (DCP's .metadata is what moves)."""
        s, d = self.path(src), self.path(dst)

        def run() -> None:
            try:
                self.backend.copy(self, s, d)
            except FileNotFoundError:
                if not self.fs.exists(d):
                    raise
                return  # an earlier attempt moved it and lost the reply
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(s)

        self.call(f"move {src} -> {dst}", run)

    # ------------------------------------------------------------------ whole files
    def checksum(
        self, rel: str, *, size: int | None = None, algorithm: str = DEFAULT
    ) -> tuple[int, int]:
        """(checksum, size) of a stored file, read back from storage (`size`: if known)."""
        if not self.is_local:
            with self.open_read(rel, size=size) as f:
                return checksum_of(f, algorithm)

        def run() -> tuple[int, int]:
            with open(self.path(rel), "rb") as f:
                if hasattr(os, "posix_fadvise"):  # larger read-ahead: cold 1 GiB 3-5x faster
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                return checksum_of(f, algorithm)

        return self.call(f"checksum {rel}", run)

    def fetch(self, rel: str, *, size: int, algorithm: str = DEFAULT) -> tuple[Buffer, int]:
        """(content, checksum) of file `rel` of `size` bytes, read once.

        Locally a read-only memory map: the bytes stay in the page cache, with no copy into
        the process, and whoever reads the content next reads those pages. Remotely in parts
        of `part_size`, `concurrency` at a time, each one retried call, into memory; the
        checksum runs over each part in order as it arrives. OSError when the file holds
        fewer bytes than `size` (changed or truncated while being read)."""
        update = updater(algorithm)
        if self.is_local:
            data = self.call(
                f"read {rel}", lambda: map_file(self.path(rel), size, self.url_of(rel))
            )
            return data, update(data, 0)
        return read_whole(
            self._ranges(rel),
            size,
            part_size=self.part_size,
            concurrency=self.concurrency,
            name=self.url_of(rel),
            update=update,
        )

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Make `data` visible at `rel` at once: tmp+fsync+rename locally, one PUT remotely."""
        target = self.path(rel)
        if not self.is_local:
            self.call(f"put {rel}", lambda: self.fs.pipe_file(target, data))
            return

        self.call(f"write {rel}", lambda: write_atomic(target, data))

    def open_write(self, rel: str) -> UploadStream:
        """A stream that uploads file `rel` in parts; it appears at `close()`, never before.

        Remote only (local files are written by DCP itself). Call `abort()` on failure.
        """
        return UploadStream(
            self.backend.sink(self, rel),
            part_size=self.part_size,
            concurrency=self.concurrency,
            name=self.url_of(rel),
        )

    def open_read(self, rel: str, *, size: int | None = None) -> io.BufferedReader:
        """A seekable reader of remote file `rel`: ranged reads in blocks, each retried."""
        if size is None:
            size = self.size(rel)
        raw = BlockReader(
            self._ranges(rel),
            size,
            block_size=self.part_size,
            concurrency=self.concurrency,
            name=self.url_of(rel),
        )
        return io.BufferedReader(raw, buffer_size=1 << 20)

    def _ranges(self, rel: str) -> Callable[[int, int], bytes]:
        """`fetch(start, end)` of remote file `rel`: one ranged read, retried."""
        path = self.path(rel)

        def fetch(start: int, end: int) -> bytes:
            return self.call(
                f"read {rel} [{start}:{end}]",
                lambda: self.fs.cat_file(path, start=start, end=end),
            )

        return fetch

    # ------------------------------------------------------------------ start-up check
    def check_writable(self) -> None:
        """Prove the root writable, listable and deletable; raise StorageError naming the fix.

        Creates the root if needed (never a bucket). Waits at most the retry budget.
        """
        probe = f".resilient-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.makedirs()
            self.call("probe write", lambda: self.fs.pipe_file(self.path(probe), b"ok"))
            self.call("probe list", lambda: self.fs.ls(self.root, detail=False))
            self.call("probe delete", lambda: self.fs.rm_file(self.path(probe)))
        except Exception as e:  # any failure here is a configuration problem: say which
            # a write cut short (a full disk) may leave the probe behind
            with contextlib.suppress(Exception):
                self.fs.rm_file(self.path(probe))
            raise self.error(e, "is not writable") from e

    def error(self, exc: BaseException, what: str) -> StorageError:
        """A StorageError saying that this location `what`, why, and how to fix it: one line,
        credentials redacted."""
        if is_explained(exc) and exc.__cause__ is not None:
            exc = exc.__cause__  # said by `call` already: say it again for `what`
        hint = self.backend.explain(self, exc)
        return location_error(f"checkpoint location {self.url!r} {what}", exc, hint, self.redact)

    def explain(self, exc: BaseException) -> str | None:
        """How to fix the configuration problem behind `exc` (a missing bucket, refused
        credentials, an unreachable endpoint, ...); None when it is not one we recognise, or
        when `exc` is a StorageError of ours that says it already."""
        return None if is_explained(exc) else self.backend.explain(self, exc)
