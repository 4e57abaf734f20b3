"""Which storage errors are worth another attempt: the one classification every retry uses.

Transient: timeouts, connection resets, 5xx and throttling (S3 codes, HTTP statuses, errno
values, and the exception names of the layers below botocore). Never: missing things (404,
NoSuchBucket), refused credentials or permissions (403), a full or read-only disk.

A configuration problem (what a Backend's `explain` recognises) becomes one StorageError line
that names the location and the fix (`location_error`), marked so that no layer above says it
twice.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from resilient.errors import StorageError
from resilient.storage import s3

__all__ = ["is_explained", "is_retryable", "location_error"]

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


def is_retryable(exc: BaseException) -> bool:
    """True for errors that a later attempt may not see: timeouts, resets, 5xx and throttling.

    Never for missing things (NoSuchBucket, 404), refused credentials or permissions (403).
    """
    code, status = s3.error_code(exc)
    if code is not None or status is not None:
        return code in _RETRYABLE_CODES or status in _RETRYABLE_STATUS
    if s3.is_connection_error(exc):
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


_HINT = "_resilient_hint"
"""Attribute of a StorageError whose message already says how to fix its cause."""
_CAUSE_CHARS = 240
"""Most characters of the underlying error quoted before a recognised problem's fix."""
_FALLBACK_FIX = (
    "Create it with write permission for this user, or point checkpoint_dir at a writable location."
)


def location_error(
    what: str, exc: BaseException, hint: str | None, redact: Callable[[str], str]
) -> StorageError:
    """One line: `what` happened, because of `exc`, and `hint` (else a generic fix); redacted.

    With a `hint` (a configuration problem recognised), the error is marked explained: the
    layers above add no second hint and do not wrap it again."""
    cause = " ".join(f"{type(exc).__name__}: {exc}".split())
    if hint is not None and len(cause) > _CAUSE_CHARS:  # the hint says what matters
        cause = cause[:_CAUSE_CHARS] + "..."
    err = StorageError(redact(f"{what} ({cause}). {hint or _FALLBACK_FIX}"))
    if hint is not None:
        setattr(err, _HINT, hint)
    return err


def is_explained(exc: BaseException) -> bool:
    """Whether `exc` is a StorageError of `location_error` that names the fix already."""
    return getattr(exc, _HINT, None) is not None
