"""resilient's one structlog pipeline: JSON lines to a file, readable lines on the console.

Every event of the package goes through a logger of our own, built with
`structlog.wrap_logger` and its own processors, wrapper and context classes, so whatever the
user configured for structlog (`structlog.configure`) or for `logging` neither silences nor
reshapes our events, and we never change the user's configuration. `configure()` (called by
`resilient.init()`) points the runtime's logger at `<run_dir>/logs/rank<R>.jsonl`;
`open_event_log()` makes another logger of the same pipeline for another file (the
supervisor's `supervisor.jsonl`). Event names and readers live in `resilient.events`.
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

__all__ = ["EventLog", "configure", "get_logger", "log_path", "open_event_log"]

# Held while an event is written (JSON file and console) and across fork(). Without it, a
# process forked while another thread was writing an event (the watchdog's thread, say) got a
# copy of a lock held by a thread that does not exist in it, and its own first event hung
# forever (tests/test_fork_safety.py: with structlog's own lock, 23 of 30 children hung).
_write_lock = threading.RLock()
_CONSOLE_HIDDEN = {"run_id", "pid", "ts", "source", "host"}  # in the JSON file; console noise
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


class _Stderr:
    """The end of the pipeline: one line to the *current* sys.stderr (which pytest and users
    may replace after import; structlog's PrintLogger would keep the old one)."""

    def msg(self, message: str) -> None:
        with _write_lock:
            print(message, file=sys.stderr, flush=True)

    debug = info = warning = warn = error = err = critical = exception = fatal = msg


class EventLog:
    """One pipeline: static fields added, JSON to `path` (if any), text to stderr from
    `console_level` up. `logger` is its structlog BoundLogger."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        static: dict[str, Any] | None = None,
        console_level: str = "INFO",
    ) -> None:
        self._file: TextIO | None = None
        self.path: Path | None = None
        self.static: dict[str, Any] = {}
        self.console_level = logging.INFO
        self._json = structlog.processors.JSONRenderer(sort_keys=False, default=str)
        self._console = structlog.dev.ConsoleRenderer(colors=False, pad_event_to=28)
        self.reopen(path, static=static, console_level=console_level)
        self.logger: Any = structlog.wrap_logger(
            _Stderr(),
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                self._add_static,
                structlog.processors.format_exc_info,
                self._tee,
            ],
            # explicit, so nothing of the global structlog configuration applies
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            context_class=dict,
            cache_logger_on_first_use=True,
        )

    def reopen(
        self,
        path: str | os.PathLike[str] | None,
        *,
        static: dict[str, Any] | None = None,
        console_level: str = "INFO",
    ) -> None:
        """Write to `path` from now on (appending; None: console only)."""
        self.close()
        if path is not None:
            _install_fork_handlers()
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self.static = dict(static or {})
        self.console_level = _LEVELS[console_level.upper()]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self.path = None, None

    def _add_static(self, logger: Any, method: str, ev: MutableMapping[str, Any]) -> Any:
        for k, v in self.static.items():
            ev.setdefault(k, v)
        return ev

    def _tee(self, logger: Any, method: str, ev: MutableMapping[str, Any]) -> Any:
        level = _LEVELS.get(str(ev.get("level", "info")).upper(), logging.INFO)
        if self._file is not None:
            line = str(self._json(logger, method, dict(ev))) + "\n"
            with _write_lock:
                self._file.write(line)
                self._file.flush()
        if level >= self.console_level:
            short = {k: v for k, v in ev.items() if k not in _CONSOLE_HIDDEN}
            return self._console(logger, method, short)
        raise structlog.DropEvent

    # the few methods callers use, so an EventLog can stand where a logger does
    def info(self, event: str, **fields: Any) -> None:
        self.logger.info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.logger.warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.logger.error(event, **fields)


def _before_fork() -> None:
    _write_lock.acquire()  # waits until no thread is in the middle of an event


def _after_fork_in_parent() -> None:
    _write_lock.release()


def _after_fork_in_child() -> None:
    global _write_lock
    _write_lock = threading.RLock()  # the parent's copy is held by the forking thread


_fork_handlers = False


def _install_fork_handlers() -> None:
    """Once per process, when the first event log opens (importing has no side effects)."""
    global _fork_handlers
    if not _fork_handlers:
        os.register_at_fork(
            before=_before_fork,
            after_in_parent=_after_fork_in_parent,
            after_in_child=_after_fork_in_child,
        )
        _fork_handlers = True


_RUNTIME = EventLog()
"""The in-worker pipeline: console only until configure() gives it the rank's file."""


def get_logger(**initial: Any) -> Any:
    """The runtime's structlog logger; events carry `run_id`, `rank`, `restart` once
    `configure` ran."""
    return _RUNTIME.logger.bind(**initial) if initial else _RUNTIME.logger


def log_path() -> Path | None:
    """The JSON log the runtime writes to now (None before configure())."""
    return _RUNTIME.path


def configure(
    *,
    run_dir: str | os.PathLike[str] | None,
    run_id: str,
    rank: int,
    restart: int,
    console_level: str = "INFO",
) -> Path | None:
    """Route resilient's events to `<run_dir>/logs/rank<R>.jsonl` and to stderr.

    Returns the JSON log path (None without a run directory). Safe to call twice: the second
    call reopens the file (a restarted worker appends to the same file).
    """
    path = None if run_dir is None else Path(run_dir) / "logs" / f"rank{rank}.jsonl"
    static = {"run_id": run_id, "rank": rank, "restart": restart, "pid": os.getpid()}
    _RUNTIME.reopen(path, static=static, console_level=console_level)
    return path


def open_event_log(
    path: str | os.PathLike[str], *, static: dict[str, Any], console_level: str = "INFO"
) -> EventLog:
    """Another logger of the same pipeline, for a process that is not a rank (the
    supervisor). Close it with `.close()`."""
    return EventLog(path, static=static, console_level=console_level)
