"""Checkpoint storage on any fsspec URL: a local directory by default, s3:// through s3fs.

Knows nothing about torch. Every call that touches storage goes through one tenacity policy
(`RetryPolicy`), so transient errors are retried with backoff inside a bounded time budget and
permanent ones fail at once. For S3 the retry loops of botocore and s3fs are reduced to a
single attempt (see resilient/_s3.py), so this policy is the only one and its budget holds.

Remote files are written and read in parts (resilient/_transfer.py): each part is one retried
call, several run at a time, and a file appears only once its upload completes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import posixpath
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import tenacity

from resilient import _s3
from resilient._transfer import BlockReader, UploadStream
from resilient.checksum import DEFAULT, checksum_of, updater
from resilient.errors import ConfigError, StorageError
from resilient.log import get_logger

__all__ = ["RetryPolicy", "Storage", "is_retryable"]

T = TypeVar("T")
Buffer = bytes | bytearray | mmap.mmap
"""Bytes in memory or mapped from a file."""
_PART = 16 << 20
"""Part size of uploads and block size of reads unless storage_options set
`default_block_size` (s3fs's own default, 50 MiB, holds 500 MiB per file in flight and starts
uploading late; 16 MiB measured as fast, see docs/benchmarks.md)."""
# errno values worth retrying on a local or network filesystem; ENOSPC, EACCES, EROFS are not.
# EBUSY and EREMOTEIO are what s3fs turns S3's 503 SlowDown and 500 InternalError into.
_RETRYABLE_ERRNO = {
    errno.EAGAIN,
    errno.EINTR,
    errno.EIO,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.EBUSY,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
# S3 (and S3-compatible) error codes that a later attempt may not see.
_RETRYABLE_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "BandwidthLimitExceeded",
    "OperationAborted",
    "BadDigest",
    "XAmzContentSHA256Mismatch",
}
_RETRYABLE_STATUS = {429, 500, 502, 503, 504}
# Errors raised below botocore's translation (aiohttp, urllib3, s3fs), named to avoid imports.
_RETRYABLE_NAMES = {
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientOSError",
    "IncompleteRead",
    "ResponseParserError",
    "FSTimeoutError",
}
# Object stores have no directories: makedirs would create a bucket (s3fs, gcsfs) or nothing.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci"}


def is_retryable(exc: BaseException) -> bool:
    """True for errors that a later attempt may not see: timeouts, resets, 5xx and throttling.

    Never for missing things (NoSuchBucket, 404), refused credentials or permissions (403).
    """
    code, status = _s3.error_code(exc)
    if code is not None or status is not None:
        return code in _RETRYABLE_CODES or status in _RETRYABLE_STATUS
    if _s3.is_connection_error(exc):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    if type(exc).__name__ in _RETRYABLE_NAMES:
        return True
    text = f"{type(exc).__name__} {exc}"
    if any(
        s in text
        for s in (
            "SlowDown",
            "Throttl",
            "ServiceUnavailable",
            "InternalError",
            "RequestTimeout",
            "503",
            "500 ",
            "502",
            "504",
        )
    ):
        return True
    return isinstance(exc, OSError) and exc.errno in _RETRYABLE_ERRNO


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How storage calls are retried. One instance is shared by every call of a Storage.

    An attempt is bounded by the transport's own timeouts (s3fs: connect 5 s, read 15 s;
    set `connect_timeout`/`read_timeout` in storage_options' config_kwargs to change them),
    so a call gives up within `budget_s` plus one attempt.
    """

    max_attempts: int = 8
    """Attempts per call, the first included."""
    budget_s: float = 120.0
    """Total seconds one call may spend retrying before it fails loudly."""
    save_budget_s: float | None = 600.0
    """Retry budget of one checkpoint save, in seconds from its start: once spent, a failing
    call is not retried any more and the save fails loudly; the previous checkpoint stays the
    newest valid one. A save that meets no error is never cut short. None: only the per-call
    limits apply."""
    initial_wait_s: float = 0.2
    """First backoff; doubles each attempt, plus up to `jitter_s` of random jitter, up to
    `max_wait_s`."""
    max_wait_s: float = 10.0
    """Largest single backoff."""
    jitter_s: float = 0.5
    """Random extra wait per retry, so ranks that failed together do not retry together."""
    sleep: Callable[[float], None] = field(default=tenacity.nap.sleep, repr=False)
    """Injected by tests to drive time without sleeping."""
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    """Time source of the save budget (tests drive it together with `sleep`)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.budget_s <= 0:
            raise ConfigError(f"RetryPolicy.budget_s must be > 0 seconds, got {self.budget_s}")
        if self.save_budget_s is not None and self.save_budget_s <= 0:
            raise ConfigError(
                f"RetryPolicy.save_budget_s must be > 0 seconds or None, got {self.save_budget_s}"
            )
        if not 0 < self.initial_wait_s <= self.max_wait_s:
            raise ConfigError(
                "RetryPolicy needs 0 < initial_wait_s <= max_wait_s, got "
                f"{self.initial_wait_s} and {self.max_wait_s}"
            )
        if self.jitter_s < 0:
            raise ConfigError(f"RetryPolicy.jitter_s must be >= 0, got {self.jitter_s}")

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        deadline: float | None = None,
        redact: Callable[[str], str] | None = None,
    ) -> T:
        """Run `fn` under the policy; `what` names the operation in events and errors.

        Retryable errors are retried until `max_attempts`, `budget_s` or `deadline` (a
        `clock()` time) would be passed; then StorageError says what failed, how often and
        why it stopped. Other errors are raised unchanged at once. Waits at most `budget_s`
        plus one attempt.
        """
        log = get_logger()
        scrub = redact or _redact
        start = self.clock()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "storage.retry",
                op=what,
                attempt=state.attempt_number,
                wait_s=round(state.upcoming_sleep, 3),
                error=scrub(f"{type(exc).__name__}: {exc}"),
            )

        stop = _Stop(self, start=start, deadline=deadline)
        retrying = tenacity.Retrying(
            stop=stop,
            wait=_Backoff(self),
            retry=tenacity.retry_if_exception(is_retryable),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as e:
            if not is_retryable(e):
                raise
            attempts = retrying.statistics.get("attempt_number", 1)
            elapsed = self.clock() - start
            raise StorageError(
                scrub(
                    f"{what} failed after {attempts} attempt(s) in {elapsed:.1f} s, {stop.reason}: "
                    f"{type(e).__name__}: {e}"
                )
            ) from e


class _Backoff(tenacity.wait.wait_base):
    """Exponential backoff plus jitter drawn from a private RNG.

    tenacity's own jitter draws from the global `random` module, which the training loop's
    RNG state shares: a retry would then change what a resumed run draws and break exact
    resume. A private generator keeps storage trouble out of the training RNG.
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.rng = random.Random()

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        p = self.policy
        exp = p.initial_wait_s * 2 ** (retry_state.attempt_number - 1)
        return min(p.max_wait_s, exp + self.rng.uniform(0, p.jitter_s))


class _Stop(tenacity.stop.stop_base):
    """Stop retrying when another attempt would pass a limit; `reason` says which.

    Uses the policy's clock (not tenacity's), so tests can drive all three limits.
    """

    def __init__(self, policy: RetryPolicy, *, start: float, deadline: float | None) -> None:
        self.policy = policy
        self.start = start
        self.deadline = deadline
        self.reason = ""

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        p = self.policy
        next_start = p.clock() + retry_state.upcoming_sleep
        if retry_state.attempt_number >= p.max_attempts:
            self.reason = f"max_attempts={p.max_attempts} reached"
        elif self.deadline is not None and next_start >= self.deadline:
            self.reason = "the save's time budget (RetryPolicy.save_budget_s) is spent"
        elif next_start - self.start >= p.budget_s:
            self.reason = f"the per-call budget of {p.budget_s:g} s (RetryPolicy.budget_s) is spent"
        else:
            return False
        return True


def _redact(text: str, extra: tuple[str, ...] = ()) -> str:
    """Drop anything that looks like a credential from a message before it is shown."""
    secrets = [os.environ.get(k, "") for k in _SECRET_ENV] + list(extra)
    for val in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(val, "***")
    return text


_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_USERINFO = re.compile(r"^([a-zA-Z][\w+.-]*://)[^/@]*@")


class _PipeSink:
    """Uploads for fsspec filesystems without multipart: the whole file in one call."""

    multipart = False

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage = storage
        self._rel = rel

    def put(self, data: bytes) -> None:
        path = self._storage.path(self._rel)
        self._storage._call(f"put {self._rel}", lambda: self._storage.fs.pipe_file(path, data))

    # never called: multipart is False
    def start(self) -> str:
        raise NotImplementedError

    def part(self, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]:
        raise NotImplementedError

    def complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def abort(self, upload_id: str) -> None:
        raise NotImplementedError


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
        self.url = _USERINFO.sub(r"\1***@", raw)  # never show user:password@ from a URL
        self.retry = retry or RetryPolicy()
        options = dict(storage_options or {})
        protocol = raw.split("://", 1)[0] if "://" in raw else "file"
        self.is_s3 = protocol in _s3.PROTOCOLS
        if self.is_s3:
            options = _s3.prepare_options(options)
        self._secrets = tuple(_s3.secrets_of(options))
        try:
            self.fs, root = fsspec.core.url_to_fs(raw, **options)
        except (ImportError, ValueError, TypeError) as e:
            raise ConfigError(
                f"cannot open checkpoint location {self.url!r}: {self.redact(str(e))}"
            ) from e
        if self.is_s3:
            _s3.tune_filesystem(self.fs)
        self.root = root.rstrip("/") or "/"
        protocols = _protocols(self.fs)
        self.is_local = "file" in protocols or "local" in protocols
        self.is_object_store = bool(_OBJECT_STORES & set(protocols))
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
        return _redact(text, self._secrets)

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

    def _call(self, what: str, fn: Callable[[], T], *, cleanup: bool = False) -> T:
        """`fn` under the retry policy. A `cleanup` call (aborting an upload after a failure)
        is retried past the save's deadline: it keeps a failed save from leaving garbage."""
        deadline = None if cleanup else self._deadline
        return self.retry.call(f"{what} at {self.url}", fn, deadline=deadline, redact=self.redact)

    # ------------------------------------------------------------------ small calls
    def exists(self, rel: str) -> bool:
        return self._call(f"exists {rel}", lambda: self.fs.exists(self.path(rel)))

    def is_file(self, rel: str) -> bool:
        """Whether file `rel` exists (one HEAD on S3; `exists` also looks for a directory)."""
        if not self.is_s3:
            return self._call(f"exists {rel}", lambda: self.fs.isfile(self.path(rel)))
        bucket, key, _ = self.fs.split_path(self.path(rel))

        def head() -> bool:
            try:
                self.fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return False
            return True

        return self._call(f"exists {rel}", head)

    def list_dirs(self) -> list[str]:
        """Names of the directories directly under the root ([] when the root does not exist)."""

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.root, detail=True)
            except FileNotFoundError as e:
                if _s3.error_code(e)[0] == "NoSuchBucket":  # an absent prefix is fine
                    raise self.error(e, "cannot be listed") from e
                return []
            return [
                posixpath.basename(e["name"].rstrip("/"))
                for e in entries
                if e.get("type") == "directory"
            ]

        return self._call("list", ls)

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

        entries = self._call(f"list {rel}", ls)
        return {
            posixpath.basename(e["name"]): int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    def list_files(self, rel: str) -> list[str]:
        """File names directly inside directory `rel`."""
        return list(self.list_sizes(rel))

    def size(self, rel: str) -> int:
        return int(self._call(f"size {rel}", lambda: self.fs.size(self.path(rel))))

    def read_bytes(self, rel: str) -> bytes:
        return self._call(f"read {rel}", lambda: self.fs.cat_file(self.path(rel)))

    def makedirs(self, rel: str = "") -> None:
        """Create directory `rel`; nothing on object stores, which have no directories (and
        where s3fs would otherwise create a missing bucket)."""
        if self.is_object_store:
            return
        self._call(f"mkdir {rel}", lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def remove_tree(self, rel: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(rel), recursive=True)

        self._call(f"remove {rel}", run)

    def remove_file(self, rel: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(rel))

        self._call(f"remove {rel}", run)

    def move(self, src: str, dst: str) -> None:
        """Move file `src` to `dst`. On object stores a copy then a delete: not atomic, so
        nothing may rely on it for a commit. Safe to retry after a partial success. On S3 a
        single CopyObject: files up to 5 GB (DCP's .metadata is what moves)."""
        s, d = self.path(src), self.path(dst)

        def copy() -> None:
            if self.is_s3:  # one request; s3fs's cp_file asks for the size first
                bucket, key, _ = self.fs.split_path(s)
                dbucket, dkey, _ = self.fs.split_path(d)
                source = {"Bucket": bucket, "Key": key}
                self.fs.call_s3("copy_object", Bucket=dbucket, Key=dkey, CopySource=source)
            else:
                self.fs.cp_file(s, d)

        def run() -> None:
            try:
                copy()
            except FileNotFoundError:
                if not self.fs.exists(d):
                    raise
                return  # an earlier attempt moved it and lost the reply
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(s)

        self._call(f"move {src} -> {dst}", run)

    # ------------------------------------------------------------------ whole files
    def checksum(
        self, rel: str, *, size: int | None = None, algorithm: str = DEFAULT
    ) -> tuple[int, int]:
        """(checksum, size) of a stored file, read back from storage (`size`: if known)."""
        if not self.is_local:
            with self.open_read(rel, size=size) as f:
                return checksum_of(f, algorithm)

        def run() -> tuple[int, int]:
            with self.fs.open(self.path(rel), "rb") as f:
                return checksum_of(f, algorithm)

        return self._call(f"checksum {rel}", run)

    def fetch(self, rel: str, *, size: int, algorithm: str = DEFAULT) -> tuple[Buffer, int]:
        """(content, checksum) of file `rel` of `size` bytes, read once.

        Locally a read-only memory map: the bytes stay in the page cache, with no copy into
        the process, and whoever reads the content next reads those pages. Remotely in parts
        of `part_size`, `concurrency` at a time, each one retried call, into memory; the
        checksum runs over each part in order as it arrives. OSError when the file holds
        fewer bytes than `size` (changed or truncated while being read)."""
        update = updater(algorithm)
        if self.is_local:

            def run() -> Buffer:
                with open(self.path(rel), "rb") as f:
                    found = os.fstat(f.fileno()).st_size
                    if found != size:
                        raise OSError(f"{self.url_of(rel)}: holds {found} bytes, expected {size}")
                    if size == 0:
                        return b""
                    return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)

            data = self._call(f"read {rel}", run)
            return data, update(data, 0)
        buf = bytearray(size)
        view = memoryview(buf)
        path = self.path(rel)
        spans = [(s, min(size, s + self.part_size)) for s in range(0, size, self.part_size)]

        def part(start: int, end: int) -> None:
            data = self._call(
                f"read {rel} [{start}:{end}]",
                lambda: self.fs.cat_file(path, start=start, end=end),
            )
            if len(data) != end - start:
                raise OSError(
                    f"{self.url_of(rel)}: read {len(data)} bytes at offset {start}, expected "
                    f"{end - start} (the object changed or was truncated while being read)"
                )
            view[start:end] = data

        value = 0
        with ThreadPoolExecutor(
            max_workers=self.concurrency, thread_name_prefix="resilient-read"
        ) as pool:
            futures = [pool.submit(part, s, e) for s, e in spans]
            try:
                for (s, e), fut in zip(spans, futures, strict=True):
                    fut.result()
                    value = update(view[s:e], value)
            finally:
                for fut in futures:
                    fut.cancel()
        return buf, value

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Make `data` visible at `rel` at once: tmp+fsync+rename locally, one PUT remotely."""
        target = self.path(rel)
        if not self.is_local:
            self._call(f"put {rel}", lambda: self.fs.pipe_file(target, data))
            return

        def run() -> None:
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(os.path.dirname(target))

        self._call(f"write {rel}", run)

    def open_write(self, rel: str) -> UploadStream:
        """A stream that uploads file `rel` in parts; it appears at `close()`, never before.

        Remote only (local files are written by DCP itself). Call `abort()` on failure.
        """
        sink = _s3.S3Sink(self.fs, self.path(rel), rel, self._call) if self.is_s3 else None
        return UploadStream(
            sink or _PipeSink(self, rel),
            part_size=self.part_size,
            concurrency=self.concurrency,
            name=self.url_of(rel),
        )

    def open_read(self, rel: str, *, size: int | None = None) -> io.BufferedReader:
        """A seekable reader of remote file `rel`: ranged reads in blocks, each retried."""
        path = self.path(rel)
        if size is None:
            size = self.size(rel)

        def fetch(start: int, end: int) -> bytes:
            return self._call(
                f"read {rel} [{start}:{end}]",
                lambda: self.fs.cat_file(path, start=start, end=end),
            )

        raw = BlockReader(
            fetch,
            size,
            block_size=self.part_size,
            concurrency=self.concurrency,
            name=self.url_of(rel),
        )
        return io.BufferedReader(raw, buffer_size=1 << 20)

    # ------------------------------------------------------------------ start-up check
    def check_writable(self) -> None:
        """Prove the root writable, listable and deletable; raise StorageError naming the fix.

        Creates the root if needed (never a bucket). Waits at most the retry budget.
        """
        probe = f".resilient-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.makedirs()
            self._call("probe write", lambda: self.fs.pipe_file(self.path(probe), b"ok"))
            self._call("probe list", lambda: self.fs.ls(self.root, detail=False))
            self._call("probe delete", lambda: self.fs.rm_file(self.path(probe)))
        except Exception as e:  # any failure here is a configuration problem: say which
            raise self.error(e, "is not writable") from e

    def error(self, exc: BaseException, what: str) -> StorageError:
        """A StorageError saying that this location `what`, why, and how to fix it."""
        hint = self.explain(exc) or (
            "Create it with write permission for this user, or point checkpoint_dir at a "
            "writable location."
        )
        return StorageError(
            self.redact(f"checkpoint location {self.url!r} {what} ({type(exc).__name__}: {exc}). ")
            + hint
        )

    def explain(self, exc: BaseException) -> str | None:
        """How to fix the configuration problem behind `exc` (a missing bucket, refused
        credentials, an unreachable endpoint, ...); None when it is not one we recognise."""
        if not self.is_s3:
            return None
        return _s3.explain(exc, self.url, _s3.endpoint_of(self.fs))


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
