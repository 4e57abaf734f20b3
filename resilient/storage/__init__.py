"""Checkpoint storage on any fsspec URL, one module per concept.

- `core`: Storage, a checkpoint root and its calls (knows nothing about torch);
- `transfer`: remote files moved in parts (uploads, ranged and whole-file reads);
- `local`: local files written durably and read as memory maps;
- `backends`: the Backend protocol, what differs per filesystem (S3's is resilient.storage.s3);
- `retry`: RetryPolicy, the one tenacity policy every call goes through;
- `classify`: which errors are worth another attempt;
- `redact`: credentials never shown.
"""

from resilient.storage.backends import Backend, FsspecBackend
from resilient.storage.classify import is_retryable
from resilient.storage.core import Buffer, Storage
from resilient.storage.local import fsync_dir
from resilient.storage.retry import RetryPolicy

__all__ = [
    "Backend",
    "Buffer",
    "FsspecBackend",
    "RetryPolicy",
    "Storage",
    "fsync_dir",
    "is_retryable",
]
