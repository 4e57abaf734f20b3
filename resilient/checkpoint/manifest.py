"""manifest.json: the record that makes a checkpoint directory a checkpoint.

Written last, by one rank, after every rank's files are durable. It lists every file with its
size and checksum (`checksum` names the algorithm: crc32c now, crc32 in format 1), so loading
can catch torn or bit-flipped files before any tensor is used. A CRC catches accidents (torn
writes, bit flips), not tampering: it is not a signature.

Format 2 (now): `"checksum": "crc32c"`, files as `{"size": N, "crc32c": V}`. Format 1:
`"checksum": "crc32"`, files as `{"size": N, "crc32": V}`. Both are read.

`"finite": true` says that every floating-point value of the model and optimizer state was
checked finite before the save wrote it (resilient/checkpoint/finite.py). It came after
format 2 without a new format number: readers ignore a key they do not know, and a manifest
without it (written before the check existed) reads as `finite=None`, unknown.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from resilient.errors import CheckpointCorruptError
from resilient.storage.checksum import ALGORITHMS, DEFAULT

if TYPE_CHECKING:
    from resilient.storage import Storage

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "parse_step_dir",
    "read_manifest",
    "step_dir",
]

FORMAT_VERSION = 2
_READABLE = (1, 2)
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")


def step_dir(step: int) -> str:
    """Directory name of the checkpoint taken after `step` steps."""
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, None for anything else (foreign objects)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    checksum: int
    """The file's checksum under the manifest's algorithm (Manifest.checksum)."""


@dataclass(kw_only=True, slots=True)
class Manifest:
    step: int
    world_size: int
    files: dict[str, FileEntry]
    torch_version: str
    resilient_version: str
    created_at: float = field(default_factory=time.time)
    user: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum: str = DEFAULT
    """The algorithm of every FileEntry.checksum (resilient.storage.checksum.ALGORITHMS)."""
    layout: str = ""
    """The saving run's mesh layout (resilient/mesh/layout.py, MeshLayout.signature): "" for
    a flat data-parallel world and for manifests written before meshes were known."""
    finite: bool | None = None
    """True: every floating-point tensor of the model and optimizer state was checked finite
    before it was written. None: not known (a manifest written before the check existed)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        d = asdict(self)
        d["files"] = {
            k: {"size": v.size, self.checksum: v.checksum} for k, v in sorted(self.files.items())
        }
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate; raise CheckpointCorruptError naming `where` on any defect."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise TypeError("not a JSON object")
            version = d.get("format_version")
            if version not in _READABLE:
                raise CheckpointCorruptError(
                    f"{where}: manifest format_version {version!r} is not supported "
                    f"(this resilient reads {list(_READABLE)}); "
                    "load it with the resilient version that wrote it"
                )
            algorithm = str(d.get("checksum", "crc32"))
            if algorithm not in ALGORITHMS:
                raise CheckpointCorruptError(
                    f"{where}: manifest checksum {algorithm!r} is not supported (this resilient "
                    f"knows {sorted(ALGORITHMS)}); load it with the resilient version that wrote it"
                )
            finite = d.get("finite")
            if finite is not None and not isinstance(finite, bool):
                raise TypeError(f"finite is {finite!r}, not true, false or null")
            files = {
                str(k): FileEntry(size=int(v["size"]), checksum=int(v[algorithm]))
                for k, v in d["files"].items()
            }
            return cls(
                step=int(d["step"]),
                world_size=int(d["world_size"]),
                files=files,
                torch_version=str(d["torch_version"]),
                resilient_version=str(d["resilient_version"]),
                created_at=float(d["created_at"]),
                user=dict(d.get("user", {})),
                format_version=int(version),
                checksum=algorithm,
                finite=finite,
                layout=str(d.get("layout") or ""),
            )
        except CheckpointCorruptError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointCorruptError(
                f"{where}: unreadable manifest ({type(e).__name__}: {e})"
            ) from e


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of checkpoint `step` under `storage`; CheckpointCorruptError when it is
    unreadable."""
    where = f"{storage.url}/{step_dir(step)}/{MANIFEST_NAME}"
    return Manifest.from_json(storage.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}"), where=where)
