"""A remote checkpoint read once: each file streamed through its check against the manifest,
the byte ranges an export reads kept in a sparse local copy.

Verifying a checkpoint reads every byte of it; reading its tensors afterwards would fetch the
model's bytes a second time. From an object store that doubles the transfer, so the check
writes the records an export needs (the `model.*` entries, `optim.*` too for the torch
format) into a local file at their own offsets as they stream by. The rest of the file is a
hole: the copy takes the disk space of the records alone. The reads then map the local copy.
The copy lives in a directory the caller names and removes; nothing is written to the export
itself until every file has passed.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from torch.distributed.checkpoint.metadata import Metadata

from resilient.checkpoint._torch_compat import read_span
from resilient.checkpoint.manifest import Manifest
from resilient.storage import Storage
from resilient.storage.checksum import updater

__all__ = ["record_ranges", "spool_checkpoint"]

_CHUNK = 8 << 20

Ranges = dict[str, list[tuple[int, int]]]
"""file name -> sorted, merged [start, end) byte ranges of it."""


def record_ranges(metadata: Metadata, prefixes: tuple[str, ...]) -> Ranges:
    """The byte ranges of each file that hold the records of the entries whose key starts
    with one of `prefixes`."""
    view = SimpleNamespace(storage_data=metadata.storage_data)
    found: dict[str, list[tuple[int, int]]] = {}
    for index in metadata.storage_data:
        if index.fqn.startswith(prefixes):
            span = read_span(view, index)  # type: ignore[arg-type]
            found.setdefault(span.file, []).append((span.offset, span.offset + span.length))
    merged: Ranges = {}
    for name, spans in found.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[name] = out
    return merged


def spool_checkpoint(
    storage: Storage, rel: str, manifest: Manifest, ranges: Ranges, into: Path
) -> list[str]:
    """Check every file of checkpoint directory `rel` against `manifest`, keeping `ranges` of
    each in a sparse file of the same name under `into`; the problems found, worded as
    CheckpointManager.verify words them (empty when every file matches)."""
    into.mkdir(parents=True, exist_ok=True)
    problems = []
    for name in sorted(manifest.files):
        problem = _spool_file(storage, rel, name, manifest, ranges.get(name, []), into / name)
        if problem is not None:
            problems.append(problem)
    return problems


def _spool_file(
    storage: Storage,
    rel: str,
    name: str,
    manifest: Manifest,
    ranges: list[tuple[int, int]],
    path: Path,
) -> str | None:
    want = manifest.files[name]
    try:
        size = storage.size(f"{rel}/{name}")
    except FileNotFoundError:
        return f"{name}: missing (expected {want.size} bytes)"
    if size != want.size:
        return f"{name}: size {size} != expected {want.size} (truncated or torn)"
    update = updater(manifest.checksum)
    value, pos = 0, 0
    buf = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buf)
    with open(path, "wb") as out, storage.open_read(f"{rel}/{name}", size=size) as f:
        out.truncate(size)  # holes where nothing is kept
        first = 0
        while n := f.readinto(buf):
            chunk = view[:n]
            value = update(chunk, value)
            while first < len(ranges) and ranges[first][1] <= pos:
                first += 1
            i = first
            while i < len(ranges) and ranges[i][0] < pos + n:
                start, end = max(ranges[i][0], pos), min(ranges[i][1], pos + n)
                os.pwrite(out.fileno(), chunk[start - pos : end - pos], start)
                i += 1
            pos += n
    if pos != want.size:
        return f"{name}: size {pos} != expected {want.size} (truncated or torn)"
    if value != want.checksum:
        algo = manifest.checksum
        return f"{name}: {algo} {value:08x} != expected {want.checksum:08x} (corrupt)"
    return None
