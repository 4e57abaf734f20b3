"""The two ends of a save's commit protocol, each run by rank 0 for every rank.

Before the write, the step's directory is made empty (or found already committed); after
every rank's files are written, manifest.json is written last and atomically, listing each
file with the checksum its writer computed. Until then the directory is an unfinished save,
which loads skip and retention deletes.
"""

from __future__ import annotations

from typing import Any

import torch

from resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    parse_step_dir,
    step_dir,
)
from resilient.checkpoint.retention import delete_checkpoint
from resilient.errors import CheckpointError
from resilient.storage import Storage
from resilient.version import __version__

__all__ = ["prepare_dir", "write_manifest"]

_DCP_METADATA = ".metadata"


def prepare_dir(storage: Storage, rel: str, *, rejected: set[int], log: Any) -> str:
    """Make checkpoint directory `rel` ready for a save: "exists" when it is committed
    already, else "fresh" (created; a torn earlier save of it, or a checkpoint of a step in
    `rejected`, deleted first)."""
    if parse_step_dir(rel) in rejected:
        log.warning("ckpt.save.replace_invalid", dir=rel)
        delete_checkpoint(storage, rel)
    else:
        present = storage.list_sizes(rel, missing_ok=True)  # one request on S3
        if MANIFEST_NAME in present:
            return "exists"
        if present:  # a torn save of this step from an earlier attempt
            log.warning("ckpt.save.clear_torn", dir=rel)
            storage.remove_tree(rel)
    storage.makedirs(rel)
    return "fresh"


def write_manifest(
    storage: Storage,
    step: int,
    world_size: int,
    entries: list[dict[str, tuple[int, int]]],
    *,
    finite: bool | None = None,
    layout: str = "",
) -> Manifest:
    """Commit checkpoint `step`: check that storage holds every file of `entries` (each rank's
    {file name: (checksum, size)}) at its size, then write the manifest. `finite`: what the
    save's check of the state found (Manifest.finite)."""
    rel = step_dir(step)
    files: dict[str, FileEntry] = {}
    for per_rank in entries:
        for name, (crc, size) in per_rank.items():
            if name.endswith(".tmp"):  # DCP writes .metadata.tmp, then renames it
                continue
            files[name] = FileEntry(size=size, checksum=crc)
    stored = storage.list_sizes(rel)  # one listing, not a request per file
    crc, size = storage.checksum(f"{rel}/{_DCP_METADATA}", size=stored.get(_DCP_METADATA))
    files[_DCP_METADATA] = FileEntry(size=size, checksum=crc)
    for name, entry in files.items():  # what storage holds is what we hashed
        found = stored.get(name)
        if found != entry.size:
            raise CheckpointError(
                f"{rel}/{name} holds {found} bytes after the write, expected {entry.size}"
            )
    manifest = Manifest(
        step=step,
        world_size=world_size,
        files=files,
        torch_version=torch.__version__,
        resilient_version=__version__,
        finite=finite,
        layout=layout,
    )
    storage.write_bytes_atomic(f"{rel}/{MANIFEST_NAME}", manifest.to_json())
    return manifest
