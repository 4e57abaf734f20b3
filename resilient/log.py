"""structlog set-up: JSON lines per rank under the run directory, readable lines on the console.

Importing this module configures nothing; `configure()` is called by `resilient.init()`.
A user who configured structlog themselves keeps their configuration (`respect_existing`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog

__all__ = ["configure", "get_logger"]

_configured_file: TextIO | None = None
# Held while an event is written (JSON file and console) and across fork(). Without it, a
# process forked while another thread was writing an event (the watchdog's thread, say) got a
# copy of the lock held by a thread that does not exist in it, and its own first event hung
# forever (tests/test_fork_safety.py: 23 of 30 children hung with structlog's own lock).
_write_lock = threading.RLock()
_fork_handlers = False
_CONSOLE_HIDDEN = {"run_id", "pid", "ts"}  # in the JSON file; noise on a console
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


def get_logger(**initial: Any) -> Any:
    """A structlog logger; events carry `run_id`, `rank`, `restart` once `configure` ran."""
    return structlog.get_logger("resilient", **initial)


class _Tee:
    """Renders each event twice: JSON to the rank's file, readable text to stderr."""

    def __init__(self, json_file: TextIO | None, console_level: int) -> None:
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        self._console = structlog.dev.ConsoleRenderer(colors=False, pad_event_to=28)
        self._file = json_file
        self._console_level = console_level

    def __call__(self, logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        level = _LEVELS.get(str(event_dict.get("level", "info")).upper(), logging.INFO)
        if self._file is not None:
            line = str(self._json(logger, method, dict(event_dict))) + "\n"
            with _write_lock:
                self._file.write(line)
                self._file.flush()
        if level >= self._console_level:
            short = {k: v for k, v in event_dict.items() if k not in _CONSOLE_HIDDEN}
            return self._console(logger, method, short)
        raise structlog.DropEvent


class _Console:
    """structlog's logger for the rendered console line: stderr, under `_write_lock` (what
    structlog's PrintLogger does under a lock of its own that nothing holds across fork)."""

    def msg(self, message: str) -> None:
        with _write_lock:
            print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


def _console_logger(*_: Any) -> _Console:
    return _Console()


def _before_fork() -> None:
    _write_lock.acquire()  # waits until no thread is in the middle of an event


def _after_fork_in_parent() -> None:
    _write_lock.release()


def _after_fork_in_child() -> None:
    global _write_lock
    _write_lock = threading.RLock()  # the parent's copy is held by the forking thread


def configure(
    *,
    run_dir: str | os.PathLike[str] | None,
    run_id: str,
    rank: int,
    restart: int,
    console_level: str = "INFO",
    respect_existing: bool = True,
) -> Path | None:
    """Route resilient's events to `<run_dir>/logs/rank<R>.jsonl` and to stderr.

    Returns the JSON log path (None without a run directory). Safe to call twice: the second
    call reopens the file (a restarted worker appends to the same file).
    """
    global _configured_file, _fork_handlers
    if respect_existing and structlog.is_configured() and _configured_file is None:
        return None
    path: Path | None = None
    if _configured_file is not None:
        _configured_file.close()
        _configured_file = None
    if run_dir is not None:
        path = Path(run_dir) / "logs" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        _configured_file = path.open("a", encoding="utf-8")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            _add_static(run_id=run_id, rank=rank, restart=restart, pid=os.getpid()),
            structlog.processors.format_exc_info,
            _Tee(_configured_file, _LEVELS[console_level.upper()]),
        ],
        logger_factory=_console_logger,
        cache_logger_on_first_use=False,
    )
    if not _fork_handlers:
        os.register_at_fork(
            before=_before_fork,
            after_in_parent=_after_fork_in_parent,
            after_in_child=_after_fork_in_child,
        )
        _fork_handlers = True
    return path


def _add_static(**fields: Any) -> Any:
    def processor(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        for k, v in fields.items():
            event_dict.setdefault(k, v)
        return event_dict

    return processor
