"""The small parts of `resilient export`'s command line: sizes as people write them, and a
progress line on a terminal (no dependency: tqdm is not one of ours)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import TextIO

__all__ = ["Progress", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes of a size written `5GB`, `500MB`, `2GiB`, `1.5GB` or `1048576` (KB/MB/GB/TB are
    powers of 1000, KiB/MiB/GiB/TiB of 1024, as Hugging Face's max_shard_size). An
    argparse error naming the valid forms otherwise."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a number of bytes (1048576) or one with a unit, "
            "KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024): 5GB, 500MB, 2GiB"
        )
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return size


class Progress:
    """`done/total` bytes and the rate, redrawn in place on `stream` at most every
    `interval` seconds; nothing at all when not `enabled`."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        interval: float = 0.25,
        label: str = "export",
    ) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self._stream = stream
        self._interval = interval
        self._label = label
        self._t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled and time.monotonic() - self._last >= self._interval:
            self._draw()

    def finish(self) -> None:
        """The last figures and a newline (only if a line was drawn, or it is enabled)."""
        if self.enabled:
            self._draw()
            print(file=self._out(), flush=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"{self._label}: {self.done / 1e6:,.0f}/{self.total / 1e6:,.0f} MB ({pct:.0f}%) "
            f"{self.done / 1e6 / elapsed:,.0f} MB/s"
        )

    def _draw(self) -> None:
        self._last = time.monotonic()
        self._drawn = True
        out = self._out()
        out.write("\r" + self.line() + "\x1b[K")
        out.flush()

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr
