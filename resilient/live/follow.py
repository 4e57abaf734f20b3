"""Follows a run's event logs as they grow: `<run_dir>/logs/*.jsonl`, read incrementally.

Each poll reads what was appended to every file since the last one, complete lines only:
a line still being written (no newline yet) is read at the next poll, from where it began.
A file that appears is read from its start; one that shrank or was replaced (another inode)
is read again from its start. A line that a killed process left torn and the next process
continued is read from the start of the last event in it. Every event gets its float `t`
(Unix seconds, from its `ts`); one without a time is not ours and is left out. A poll
returns its events in time order; events of an earlier poll may be older than some of a
later one (the files are written by different processes), which the reducer tolerates.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient import events as ev

__all__ = ["EventFollower"]


@dataclass(slots=True)
class _File:
    inode: int
    offset: int


class EventFollower:
    """`poll()` returns the events appended to the logs since the previous poll."""

    def __init__(
        self,
        logs_dir: str | os.PathLike[str],
        pattern: str = "*.jsonl",
        *,
        max_bytes: int = 32 << 20,
    ) -> None:
        self.dir = Path(logs_dir)
        self.pattern = pattern
        self.max_bytes = max_bytes
        """Read at most this much of one file per poll (a long history is caught up over a
        few polls instead of held in memory at once)."""
        self._files: dict[Path, _File] = {}
        self.bytes_read = 0

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            paths = sorted(self.dir.glob(self.pattern))
        except OSError:
            return out
        seen = set()
        for path in paths:
            seen.add(path)
            out += self._read(path)
        for gone in set(self._files) - seen:
            del self._files[gone]  # removed: a file of that name later is a new one
        out.sort(key=lambda e: e["t"])
        return out

    def _read(self, path: Path) -> list[dict[str, Any]]:
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                known = self._files.get(path)
                if known is None or known.inode != st.st_ino or st.st_size < known.offset:
                    known = self._files[path] = _File(st.st_ino, 0)
                if st.st_size == known.offset:
                    return []
                f.seek(known.offset)
                data = f.read(self.max_bytes)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        if end == 0:
            if len(data) < self.max_bytes:
                return []  # a line still being written
            end = len(data)  # one line longer than max_bytes: not an event of ours
        known.offset += end
        self.bytes_read += end
        return [e for line in data[:end].splitlines() if (e := _event(line)) is not None]


def _event(line: bytes) -> dict[str, Any] | None:
    e = _parse(line)
    if e is None and b'{"' in line[1:]:
        # torn: the start of an event cut short by a kill, then the next process's event;
        # the last event begins at one of the later '{"' (try from the left: nested
        # objects end the line with a brace too many)
        at = line.find(b'{"', 1)
        while e is None and at > 0:
            e = _parse(line[at:])
            at = line.find(b'{"', at + 1)
    if e is None:
        return None
    try:
        e["t"] = ev.timestamp(e)
    except (KeyError, TypeError, ValueError):
        return None
    return e


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        e = json.loads(line)
    except ValueError:
        return None
    return e if isinstance(e, dict) and "event" in e else None
