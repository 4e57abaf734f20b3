"""A one-line live status on stderr: `resilient run`'s, and the progress of
`resilient check-resume` and of the long benchmarks (`StatusLine`).

Modes: "line" redraws one line in place (carriage return, clear to the end of the line), at
most once a second; "plain" prints the text as an ordinary line every `every_s` seconds
(logs, pipes, CI); "auto" is "line" on a terminal and "plain" elsewhere; "off" prints
nothing. The workers write to the same terminal: a line of theirs that comes while the
status is drawn follows it on the same line, and the next redraw starts on a fresh line. The
status is only drawn again after a second, and `close()` ends it with a newline, so the
terminal never keeps a half-drawn status. While a StatusLine draws in "line" mode it can
wrap this process's own `sys.stderr` (`own_stderr`), so that the supervisor's own lines
(its events, its summary) clear the status first instead of following it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["MODES", "StatusLine", "format_duration", "resolve_mode", "run_status"]

MODES = ("auto", "line", "plain", "off")
_CLEAR = "\r\x1b[K"


def resolve_mode(mode: str, stream: TextIO) -> str:
    """ "auto" made "line" (a terminal) or "plain"; the others as they are."""
    if mode not in MODES:
        raise ValueError(f"status mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    try:
        return "line" if stream.isatty() else "plain"
    except (AttributeError, ValueError):  # no isatty, or closed
        return "plain"


class StatusLine:
    """`show(text)` draws (or prints) when due; `close(text)` draws the last one for good."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        mode: str = "auto",
        every_s: float = 30.0,
        redraw_s: float = 1.0,
        prefix: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.mode = resolve_mode(mode, self.stream)
        self.every_s = every_s if self.mode == "plain" else redraw_s
        self.prefix = prefix
        self._clock = clock
        # a plain line once there is something to say; a drawn line at once
        self._next = clock() + every_s if self.mode == "plain" else -float("inf")
        self._drawn = False
        self._lock = threading.RLock()
        self._wrapped: _Clearing | None = None
        self.closed = False

    def show(self, text: str, *, force: bool = False) -> bool:
        """Draw `text` when a redraw (a plain line) is due, or at once with `force`; True
        when it was written."""
        with self._lock:
            now = self._clock()
            if self.mode == "off" or self.closed or (now < self._next and not force):
                return False
            self._next = now + self.every_s
            self._write(self.prefix + text)
            return True

    def close(self, text: str | None = None) -> None:
        """Write `text` (if any) one last time; a drawn line ends with a newline."""
        with self._lock:
            if self.closed:
                return
            if text is not None and self.mode != "off":
                self._write(self.prefix + text)
            if self._drawn:
                self._raw("\n")
                self._drawn = False
            self.closed = True
            self._unwrap()

    def own_stderr(self) -> None:
        """In "line" mode, route this process's writes to sys.stderr through a wrapper that
        clears the drawn status first (undone by close())."""
        if self.mode == "line" and self.stream is sys.stderr and self._wrapped is None:
            self._wrapped = _Clearing(sys.stderr, self)
            sys.stderr = self._wrapped

    def _unwrap(self) -> None:
        if self._wrapped is not None and sys.stderr is self._wrapped:
            sys.stderr = self._wrapped.inner
        self._wrapped = None

    def _write(self, text: str) -> None:
        if self.mode == "line":
            self._raw(_CLEAR + text)
            self._drawn = True
        else:
            self._raw(text + "\n")

    def _raw(self, s: str) -> None:
        inner = self._wrapped.inner if self._wrapped is not None else self.stream
        try:
            inner.write(s)
            inner.flush()
        except (OSError, ValueError):  # a closed or broken stream: a status is not worth a crash
            pass

    def clear_for_others(self) -> None:
        """Someone else writes a line: take the drawn status away (redrawn when due)."""
        with self._lock:
            if self._drawn:
                self._raw(_CLEAR)
                self._drawn = False
                self._next = self._clock() + self.every_s  # let their line be read


class _Clearing:
    """sys.stderr while a status line is drawn there: clears it before anything else."""

    def __init__(self, inner: TextIO, line: StatusLine) -> None:
        self.inner = inner
        self._line = line

    def write(self, s: str) -> int:
        if s:
            self._line.clear_for_others()
        return self.inner.write(s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def format_duration(seconds: float) -> str:
    """12s, 4m05s, 3h02m, 2d04h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def run_status(
    *,
    step: int | None,
    total: int | None,
    rate: float | None,
    checkpoint_step: int | None,
    checkpoint_age_s: float | None,
    goodput: float | None,
    recoveries: dict[str, int],
    ranks: int = 0,
) -> str:
    """`resilient run`'s status: step (of total), steps/s, ETA (only when the total is
    known), the newest checkpoint and its age, goodput so far, recoveries so far."""
    parts = []
    if step is not None and checkpoint_step is not None:
        step = max(step, checkpoint_step)  # progress is logged once a second, commits at once
    if step is None:
        parts.append("starting")
    else:
        parts.append(f"step {step}" + (f"/{total}" if total else ""))
    if ranks:
        parts[-1] += f" ({ranks} ranks)"
    if rate is not None:
        parts.append(f"{rate:.3g} steps/s")
        if total and step is not None and rate > 0 and total > step:
            parts.append(f"ETA {format_duration((total - step) / rate)}")
    if checkpoint_step is not None:
        age = "" if checkpoint_age_s is None else f" ({format_duration(checkpoint_age_s)} ago)"
        parts.append(f"ckpt {checkpoint_step}{age}")
    else:
        parts.append("no ckpt yet")
    if goodput is not None:
        parts.append(f"goodput {100 * goodput:.1f}%")
    n = sum(recoveries.values())
    said = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in recoveries.items() if v)
    parts.append(f"recoveries {n}" + (f" ({said})" if said else ""))
    return " | ".join(parts)
