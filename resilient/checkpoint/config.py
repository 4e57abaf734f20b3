"""What a checkpoint manager is configured with, and what it lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resilient.errors import ConfigError
from resilient.storage import RetryPolicy

__all__ = ["CheckpointConfig", "CheckpointInfo"]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where and how checkpoints are written."""

    url: str
    """A local directory or an fsspec URL (s3://bucket/prefix). Created when missing."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones and torn leftovers are deleted after a commit."""
    async_save: bool = True
    """Write in a background thread; the loop blocks only while tensors are staged."""
    write_threads: int = 1
    """DCP writer threads per rank."""
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    """Passed to fsspec (endpoint, credentials, ...). Not in repr: it may hold secrets."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Retry policy of every storage call, and the time budget of a save."""
    local_url: str | None = None
    """A fast local directory for a second tier (resilient.checkpoint.tiers): most saves go
    there, every `remote_every`-th to `url`. It must be one directory all ranks share (one
    host, or a shared filesystem). Needs TieredCheckpointManager / open_manager()."""
    remote_every: int = 1
    """With `local_url`: every N-th save (and every explicit blocking save) goes to `url`."""
    verify_buffer_mib: int = 4096
    """Loading checks every file against the manifest before any tensor is touched. A rank
    keeps the files it checks in memory, up to this many MiB, and DCP then reads them from
    there: each byte is read once. Beyond it the check streams and DCP reads the files again
    (two reads, less memory). Peak memory of a load is about this rank's share of the
    checkpoint."""
    keep_in_page_cache: bool = False
    """Local disk: leave the files a save wrote in the page cache, so a load soon after on the
    same host reads them from memory. By default a save drops its pages behind it as they
    are written: less page cache per save, and on our test VM faster saves
    (docs/benchmarks-history.md), at the price of a restart reading the checkpoint from the
    disk."""
    on_save_error: str = "raise"
    """What a failed save does once logged (ckpt.save.failed): "raise" stops training (the
    error reaches the loop at the next save or wait), "continue" goes on training. Either way
    the previous checkpoint stays the newest valid one."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(
                f"keep_last must be >= 1 (the newest valid checkpoint is always kept), got "
                f"{self.keep_last}"
            )
        if not 1 <= self.write_threads <= 64:
            raise ConfigError(f"write_threads must be in [1, 64], got {self.write_threads}")
        if self.verify_buffer_mib < 0:
            raise ConfigError(
                f"verify_buffer_mib must be >= 0 (0: always read twice), got "
                f"{self.verify_buffer_mib}"
            )
        if self.remote_every < 1:
            raise ConfigError(f"remote_every must be >= 1, got {self.remote_every}")
        if self.local_url is not None and self.local_url.rstrip("/") == self.url.rstrip("/"):
            raise ConfigError("local_url must differ from url: they are two separate tiers")
        if self.on_save_error not in ("raise", "continue"):
            raise ConfigError(
                f'on_save_error must be "raise" or "continue", got {self.on_save_error!r}'
            )


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    committed: bool
    """Its manifest exists (an unfinished save has none)."""
    tier: str | None = None
    """TieredCheckpointManager: "local" or "remote"; None for a single tier."""
