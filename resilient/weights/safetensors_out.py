"""A streaming writer of the safetensors format: a file written a tensor at a time.

The `safetensors` library has no streaming writer: `save_file` wants every tensor of a file
in memory at once. An export must not hold a whole shard (5 GB by default), so this module
writes the documented format itself (https://huggingface.co/docs/safetensors):

    8 bytes      N, the header's length, unsigned little-endian
    N bytes      a JSON object: {name: {"dtype": "F32", "shape": [...], "data_offsets":
                 [begin, end]}, ..., "__metadata__": {str: str}}, padded with spaces so
                 that the data starts 8-byte aligned
    the data     every tensor's bytes, C order, little-endian, one after the other with no
                 gap, at the offsets the header gives (relative to the start of the data)

The header is known before any tensor is read: names, dtypes and shapes come from the
checkpoint's metadata. The writer puts it first and then takes the tensors in the header's
order, as they are read, a batch at a time. The order is the caller's, stably regrouped by
element size, larger first (as the safetensors library does): every tensor then starts at
an offset that is a multiple of its element size. `safetensors.safe_open` reads the result
(tests/test_export.py checks it tensor for tensor).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

import torch

from resilient.errors import ConfigError

__all__ = ["DTYPES", "SafetensorsWriter", "dtype_code", "write_order"]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
"""torch dtypes that safetensors holds, and their codes in the header."""

_ALIGN = 8
_DROP_BEHIND_BYTES = 64 << 20
"""Each time this much more of a file is written, its writeback starts and the round before
it leaves the page cache (as a checkpoint save does, resilient/checkpoint/_dcp_write.py)."""
_WRITE_BYTES = 8 << 20
"""write() calls of at most this much: the drops then keep up, and the page cache reuses a
few rounds of pages instead of taking fresh ones (1 GiB on our test VM: median 0.56 s in
8 MiB writes against 0.63 s in 256 MiB writes, dropping behind either way)."""


def dtype_code(dtype: torch.dtype, name: str) -> str:
    code = DTYPES.get(dtype)
    if code is None:
        raise ConfigError(
            f"{name} has dtype {dtype}, which safetensors cannot hold: export with "
            "--format torch, or drop the key with --map"
        )
    return code


def write_order(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[int]:
    """Indices of `entries` in the order their bytes go into the file: by element size,
    largest first, and in the given order within one size."""
    return sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)


class SafetensorsWriter:
    """One safetensors file at `path`: the header at once, then `write` each tensor in
    `names` order (`self.names`), then `close`. Nothing is kept in memory but the header."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str],
    ) -> None:
        order = write_order(entries)
        self.names: list[str] = [entries[i][0] for i in order]
        """The tensors, in the order `write` takes them."""
        self._expect: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
        offset = 0
        for i in order:
            name, dtype, shape = entries[i]
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            header[name] = {
                "dtype": dtype_code(dtype, name),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._expect[name] = (dtype, tuple(shape), offset, offset + nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _ALIGN)
        self.data_bytes = offset
        self.header_bytes = 8 + len(raw)
        self.path = os.fspath(path)
        self._next = 0
        self._written = 0
        self._rounds = (0, 0)  # where the previous and the newest round of bytes begin
        self._drop_behind = hasattr(os, "posix_fadvise")
        self._f: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 (closed in close/abort)
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor | list[torch.Tensor]) -> int:
        """Append `tensor`'s bytes as `name`, the next tensor in `names`; the bytes written.
        A list: the tensor's bytes in C order in pieces (runs of whole rows, in order)."""
        if self._f is None:
            raise ValueError(f"{self.path}: closed")
        if self._next >= len(self.names) or self.names[self._next] != name:
            want = self.names[self._next] if self._next < len(self.names) else "nothing"
            raise ValueError(f"{self.path}: got {name!r}, the header's next tensor is {want!r}")
        dtype, shape, begin, end = self._expect[name]
        pieces = tensor if isinstance(tensor, list) else [tensor]
        numel = 1
        for d in shape:
            numel *= d
        if (
            any(p.dtype != dtype for p in pieces)
            or sum(p.numel() for p in pieces) != numel
            or (not isinstance(tensor, list) and tuple(tensor.shape) != shape)
        ):
            got = [f"{p.dtype} {tuple(p.shape)}" for p in pieces]
            raise ValueError(f"{self.path}: {name} is {got}, the header says {dtype} {shape}")
        if self._written != begin:  # pragma: no cover - kept by construction
            raise ValueError(f"{self.path}: {name} would start at {self._written}, not {begin}")
        for piece in pieces:
            data = _raw_bytes(piece) if piece.numel() else memoryview(b"")
            for start in range(0, len(data), _WRITE_BYTES):
                self._write(data[start : start + _WRITE_BYTES])
        self._next += 1
        return end - begin

    def _write(self, chunk: memoryview) -> None:
        assert self._f is not None
        self._f.write(chunk)
        self._written += len(chunk)
        if self._drop_behind and self._written - self._rounds[1] >= _DROP_BEHIND_BYTES:
            self._drop_round()

    def _drop_round(self) -> None:
        """Start the writeback of the newest round and drop the previous round's pages: the
        file's dirty pages go to the disk while the next tensors are read, the fsync at the
        end has little left to wait for, and the page cache is reused instead of filled."""
        assert self._f is not None
        self._f.flush()
        start = self.header_bytes + self._rounds[0]
        try:
            os.posix_fadvise(
                self._f.fileno(), start, self._written - self._rounds[0], os.POSIX_FADV_DONTNEED
            )
        except OSError:  # only advice: a file system that refuses it is written as before
            self._drop_behind = False
        self._rounds = (self._rounds[1], self._written)

    def close(self) -> None:
        """Flush and fsync the file; ValueError when a tensor of the header was not written."""
        if self._f is None:
            return
        if self._next != len(self.names):
            missing = self.names[self._next :]
            self.abort()
            raise ValueError(f"{self.path}: {len(missing)} tensors never written ({missing[:3]})")
        f, self._f = self._f, None
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()

    def abort(self) -> None:
        """Close without completing (the caller removes the file)."""
        f, self._f = self._f, None
        if f is not None:
            f.close()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` in C order, little-endian, without a copy when it is contiguous
    already (a view of its memory: keep the tensor alive while it is used)."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise ConfigError("safetensors export needs a little-endian machine")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data
