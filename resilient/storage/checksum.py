"""File checksums of checkpoints: one algorithm per manifest, computed once per byte.

New manifests use CRC-32C (Castagnoli), computed by the `crc32c` package with the CPU's
SSE4.2 `crc32` instruction (a software fallback elsewhere). On the 2-vCPU development VM it
ran at 3-4 GB/s against zlib's crc32 at 1.1-1.2 GB/s (docs/benchmarks-history.md, "Checksums"), and
it releases the GIL, so hashing overlaps the write it belongs to. CRC-32C is also the
checksum S3 computes natively (`x-amz-checksum-crc32c`). Manifests written before it name
`crc32` (zlib's); they stay loadable.

A CRC catches accidents (torn writes, bit flips), not tampering: it is not a signature.
Knows nothing about torch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import IO, Any

import crc32c as _crc32c

__all__ = ["ALGORITHMS", "DEFAULT", "checksum_of", "updater"]

DEFAULT = "crc32c"
"""The algorithm of every manifest written now."""

ALGORITHMS: dict[str, Callable[[Any, int], int]] = {
    "crc32c": lambda data, value: _crc32c.crc32c(data, value),
    "crc32": lambda data, value: zlib.crc32(data, value),
}
"""name -> update(data, running value) -> new value; the running value starts at 0."""

_CHUNK = 8 << 20


def updater(algorithm: str) -> Callable[[Any, int], int]:
    """The update function of `algorithm`; ValueError names the ones we know."""
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r} (known: {sorted(ALGORITHMS)}); "
            "the checkpoint was written by a newer resilient: load it with that version"
        ) from None


def checksum_of(stream: IO[bytes], algorithm: str = DEFAULT) -> tuple[int, int]:
    """(checksum, size) of everything left in `stream`, read in chunks into one buffer
    (not a fresh one per chunk)."""
    update = updater(algorithm)
    value, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while n := stream.readinto(buf):  # type: ignore[attr-defined]
        value = update(view[:n], value)
        size += n
    return value, size
