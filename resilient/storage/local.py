"""Checkpoint files on this machine: a durable write that appears at once, and a read that
maps the file instead of copying it.

Storage (core.py) goes through fsspec for everything else; these two bypass it on a local
root because fsspec neither fsyncs nor maps. Kept apart from Storage so that it holds the
calls and their retry policy, and this module the operating-system details.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid

__all__ = ["fsync_dir", "map_file", "write_atomic"]


def map_file(path: str, size: int, name: str) -> bytes | mmap.mmap:
    """File `path` of `size` bytes as a read-only memory map (b"" when empty); OSError when
    it holds another number of bytes. `name`: the file as error messages show it."""
    with open(path, "rb") as f:
        found = os.fstat(f.fileno()).st_size
        if found != size:
            raise OSError(f"{name}: holds {found} bytes, expected {size}")
        if size == 0:
            return b""
        # A file truncated by someone else while mapped would fault (SIGBUS) on access:
        # checkpoint files are never rewritten in place once committed, and the size was
        # checked just now.
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        # Read ahead aggressively: the checksum walks the map front to back, and with the
        # default window each fault waits on a small synchronous read.
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        return mapped


def write_atomic(target: str, data: bytes) -> None:
    """Make `data` visible at `target` at once and durably: tmp + fsync + rename."""
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


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
