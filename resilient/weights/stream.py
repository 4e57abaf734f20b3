"""The tensors an export writes, in order, each ready as the one before it is written.

Two ways, per tensor:
- As saved (streaming, no dtype conversion, its records plain tensors of whole rows, as
  DDP, FSDP2 and one process save them): its bytes come as views of memory maps of the
  checkpoint's records (`CheckpointWeights.pieces`), and the writer writes them from there.
  No copy into the process; memory holds the pages of the tensor being written, which leave
  with its maps.
- Otherwise, by `dcp.load`, a batch at a time: at most `READ_BATCH_BYTES` of saved tensors
  (one tensor when it is larger). Streaming (`reuse=True`): two sets of buffers, used in
  turn, are kept from batch to batch; a thread reads (and converts) the next batch into one
  set while the caller writes this one from the other (writing to a disk and fsyncing
  release the GIL; so do torch's copies). Peak memory is about two batches, whatever the
  model's size. Fresh buffers for every batch would cost a page fault per page, which on our
  test VM cost about as much as the copy itself. Without `reuse`: fresh tensors, which the
  caller keeps (the torch format).
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from resilient.weights.checkpoint_reader import CheckpointWeights, buffer_bytes

__all__ = ["READ_BATCH_BYTES", "Item", "Piece", "StreamReader", "Times", "batches"]

READ_BATCH_BYTES = 256 << 20
"""Most bytes of saved tensors read by one dcp.load (one tensor when it is larger)."""
_ALIGN = 64
Piece = torch.Tensor | list[torch.Tensor]
"""A tensor, or its bytes in C order as a list of views (CheckpointWeights.pieces)."""


@dataclass(frozen=True, slots=True)
class Item:
    """A tensor to export."""

    name: str
    """The exported name."""
    source: str
    """The plain name in the checkpoint."""
    dtype: torch.dtype
    """The exported dtype."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Times:
    """Where an export's time went."""

    verify_s: float = 0.0
    read_s: float = 0.0
    """Waiting for reads (and dtype conversions) that the writes did not hide."""
    write_s: float = 0.0
    files: list[str] = field(default_factory=list)


def batches(items: list[Item], ckpt: CheckpointWeights) -> list[list[Item]]:
    """`items` in order, in runs of at most READ_BATCH_BYTES as saved (one when larger)."""
    out: list[list[Item]] = []
    batch: list[Item] = []
    size = 0
    for item in items:
        n = ckpt.specs[item.source].nbytes
        if batch and size + n > READ_BATCH_BYTES:
            out.append(batch)
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        out.append(batch)
    return out


class StreamReader:
    """(item, tensor) for items, in order; see the module doc."""

    def __init__(self, ckpt: CheckpointWeights, times: Times, *, reuse: bool) -> None:
        self._ckpt = ckpt
        self._times = times
        self._reuse = reuse
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def tensors(self, items: list[Item]) -> Generator[tuple[Item, Piece], None, None]:
        """(item, its tensor, or its bytes in pieces). With `reuse`, what comes is valid
        until the next batch after its own is asked for."""
        segments = self._segments(items)
        loads = [seg for seg in segments if seg[0] == "read"]
        with ThreadPoolExecutor(1, thread_name_prefix="resilient-export-read") as pool:
            pending = pool.submit(self._load, loads[0][1], 0) if loads else None
            k = 0  # the next read batch
            for kind, batch in segments:
                t = time.perf_counter()
                if kind == "view":
                    got: list[Piece] = [self._ckpt.pieces(batch[0].source) or self._alone(batch)]
                else:
                    assert pending is not None
                    got = list(pending.result())
                    k += 1
                    pending = pool.submit(self._load, loads[k][1], k) if k < len(loads) else None
                self._times.read_s += time.perf_counter() - t
                try:
                    yield from zip(batch, got, strict=True)
                except BaseException:  # the caller stopped: no read of the next batch
                    if pending is not None:
                        pending.cancel()
                    raise
                del got

    def _segments(self, items: list[Item]) -> list[tuple[str, list[Item]]]:
        """Items in order: ("view", [item]) for a tensor written from the checkpoint's own
        bytes (streaming, no conversion, its records viewable: CheckpointWeights.pieces),
        ("read", batch) for runs of the others, read by dcp.load."""
        out: list[tuple[str, list[Item]]] = []
        run: list[Item] = []
        for item in items:
            if self._reuse and self._viewable(item):
                out += [("read", b) for b in batches(run, self._ckpt)]
                out.append(("view", [item]))
                run = []
            else:
                run.append(item)
        return out + [("read", b) for b in batches(run, self._ckpt)]

    def _viewable(self, item: Item) -> bool:
        spec = self._ckpt.specs[item.source]
        if item.dtype != spec.dtype:
            return False
        pieces = self._ckpt.pieces(item.source)  # mapped, not read: a cheap look
        return pieces is not None

    def _alone(self, batch: list[Item]) -> torch.Tensor:
        """A tensor whose records turned out not viewable after all: read by itself."""
        return self._load(batch, None)[0]

    def _load(self, batch: list[Item], k: int | None) -> list[torch.Tensor]:
        """Batch number `k`, read and converted into buffer set k % 2 (fresh tensors
        without `reuse`, or without `k`)."""
        specs = [self._ckpt.specs[i.source] for i in batch]
        slot = k % 2 if self._reuse and k is not None else None
        into = self._buffer("read", slot, buffer_bytes(specs)) if slot is not None else None
        got = self._ckpt.read([i.source for i in batch], into=into)
        converted = [i for i, spec in zip(batch, specs, strict=True) if i.dtype != spec.dtype]
        size = sum(i.nbytes + (-i.nbytes % _ALIGN) for i in converted)
        out = self._buffer("convert", slot, size) if slot is not None and converted else None
        tensors = []
        offset = 0
        for item in batch:
            tensor = got.pop(item.source)
            if tensor.dtype != item.dtype:
                if out is None:
                    tensor = tensor.to(item.dtype)
                else:
                    end = offset + item.nbytes
                    tensor = out[offset:end].view(item.dtype).view(item.shape).copy_(tensor)
                    offset = end + (-end % _ALIGN)
            tensors.append(tensor)
        return tensors

    def _buffer(self, which: str, slot: int, size: int) -> torch.Tensor:
        key = (which, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < size:
            self._buffers.pop(key, None)  # the old one goes before the new one comes
            buf = self._buffers[key] = torch.empty(max(size, 1), dtype=torch.uint8)
        return buf
