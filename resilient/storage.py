"""Checkpoint storage on any fsspec URL: a local directory by default, s3:// through s3fs.

Knows nothing about torch. Every call that touches storage goes through one tenacity policy
(`RetryPolicy`), so transient errors are retried with backoff inside a bounded time budget and
permanent ones fail at once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import fsspec
import tenacity

from resilient.errors import ConfigError, StorageError
from resilient.log import get_logger

__all__ = ["RetryPolicy", "Storage", "crc32_of"]

T = TypeVar("T")
_CHUNK = 8 << 20
# errno values worth retrying on a local or network filesystem; ENOSPC, EACCES, EROFS are not.
_RETRYABLE_ERRNO = {errno.EAGAIN, errno.EINTR, errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET}


def is_retryable(exc: BaseException) -> bool:
    """True for errors that a later attempt may not see: timeouts, resets, 5xx and throttling."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return False
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
    """How storage calls are retried. One instance is shared by every call of a Storage."""

    max_attempts: int = 8
    """Attempts per call, the first included."""
    budget_s: float = 120.0
    """Total seconds one call may spend retrying before it fails loudly."""
    initial_wait_s: float = 0.2
    """First backoff; doubles each attempt, with jitter, up to `max_wait_s`."""
    max_wait_s: float = 10.0
    """Largest single backoff."""
    sleep: Callable[[float], None] = field(default=tenacity.nap.sleep, repr=False)
    """Injected by tests to drive time without sleeping."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.budget_s <= 0:
            raise ConfigError(f"RetryPolicy.budget_s must be > 0 seconds, got {self.budget_s}")
        if not 0 < self.initial_wait_s <= self.max_wait_s:
            raise ConfigError(
                "RetryPolicy needs 0 < initial_wait_s <= max_wait_s, got "
                f"{self.initial_wait_s} and {self.max_wait_s}"
            )

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn` under the policy; `what` names the operation in events and errors."""
        log = get_logger()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "storage.retry",
                op=what,
                attempt=state.attempt_number,
                wait_s=round(state.next_action.sleep, 3) if state.next_action else None,
                error=_redact(repr(exc)),
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts)
            | tenacity.stop_after_delay(self.budget_s),
            wait=tenacity.wait_exponential_jitter(initial=self.initial_wait_s, max=self.max_wait_s),
            retry=tenacity.retry_if_exception(is_retryable),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn)


def _redact(text: str) -> str:
    """Drop anything that looks like a credential from a message before it is logged."""
    for key in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        val = os.environ.get(key)
        if val:
            text = text.replace(val, "***")
    return text


def crc32_of(stream: IO[bytes]) -> tuple[int, int]:
    """(crc32, size) of everything left in `stream`, read in chunks."""
    crc, size = 0, 0
    while chunk := stream.read(_CHUNK):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return crc, size


class Storage:
    """A checkpoint root on an fsspec filesystem; paths given to methods are relative to it."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        url = os.fspath(url)
        if not url:
            raise ConfigError("checkpoint location is empty: give a directory or an fsspec URL")
        self.url = url
        self.retry = retry or RetryPolicy()
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise ConfigError(f"cannot open checkpoint location {url!r}: {e}") from e
        self.root = root.rstrip("/") or "/"
        self.is_local = "file" in _protocols(self.fs)
        if self.is_local:
            self.root = os.path.abspath(self.root)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def path(self, *parts: str) -> str:
        """The absolute path (no protocol) of `parts` below the root."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def url_of(self, *parts: str) -> str:
        """`parts` below the root as a URL with its protocol (s3://bucket/...)."""
        return str(self.fs.unstrip_protocol(self.path(*parts)))

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self.retry.call(what, fn)

    def exists(self, rel: str) -> bool:
        return self._call(f"exists {rel}", lambda: self.fs.exists(self.path(rel)))

    def list_dirs(self) -> list[str]:
        """Names of the directories directly under the root ([] when the root does not exist)."""

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return []
            return [
                posixpath.basename(e["name"].rstrip("/"))
                for e in entries
                if e.get("type") == "directory"
            ]

        return self._call("list", ls)

    def size(self, rel: str) -> int:
        return int(self._call(f"size {rel}", lambda: self.fs.size(self.path(rel))))

    def read_bytes(self, rel: str) -> bytes:
        return self._call(f"read {rel}", lambda: self.fs.cat_file(self.path(rel)))

    def checksum(self, rel: str) -> tuple[int, int]:
        """(crc32, size) of a stored file, read back from storage."""

        def run() -> tuple[int, int]:
            with self.fs.open(self.path(rel), "rb") as f:
                return crc32_of(f)

        return self._call(f"checksum {rel}", run)

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

    def makedirs(self, rel: str = "") -> None:
        self._call(f"mkdir {rel}", lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def remove_tree(self, rel: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(rel), recursive=True)

        self._call(f"remove {rel}", run)

    def list_files(self, rel: str) -> list[str]:
        """File names directly inside directory `rel`."""
        entries = self._call(f"list {rel}", lambda: self.fs.ls(self.path(rel), detail=True))
        return [posixpath.basename(e["name"]) for e in entries if e.get("type") == "file"]

    def check_writable(self) -> None:
        """Create the root if needed and prove it writable; raise StorageError naming the fix."""
        probe = f".resilient-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.makedirs()
            self._call("probe", lambda: self.fs.pipe_file(self.path(probe), b"ok"))
            self._call("probe cleanup", lambda: self.fs.rm(self.path(probe)))
        except (OSError, ValueError) as e:
            raise StorageError(
                f"checkpoint location {self.url!r} is not writable ({type(e).__name__}: "
                f"{_redact(str(e))}). Create it with write permission for this user, or point "
                "checkpoint_dir at a writable location."
            ) from e


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
