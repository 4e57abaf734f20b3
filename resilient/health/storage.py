"""The checkpoint location: does it answer, can this node write there, is there room for one
more checkpoint.

Every call goes through resilient.storage.Storage and its one retry policy (RetryPolicy), with
a budget of its own (PROBE_BUDGET_S over the whole check, at most PROBE_RETRY["max_attempts"]
attempts a call): a save may retry for minutes, but a node that waits that long before a
rendezvous round holds every other node back. Transient errors are still retried within it,
so one dropped request does not keep a node out.

- checkpoint_reachable: the root is listed within the budget.
- checkpoint_space: Storage.check_writable writes, lists and deletes a probe of a unique name
  (nothing inside a checkpoint directory is touched), and on a local filesystem the free
  space must hold the newest committed checkpoint again, as its manifest records it: the
  next save is written whole before retention deletes an old one.
  Object stores have no free space to measure; without a committed checkpoint there is
  nothing to size, and only writability is checked.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from typing import Any

from resilient.errors import CheckpointCorruptError
from resilient.health.report import CheckResult, failed_check, fmt_bytes, ok_check, skipped_check
from resilient.storage import RetryPolicy, Storage

__all__ = [
    "LIMIT_S",
    "PROBE_BUDGET_S",
    "PROBE_RETRY",
    "REACHABLE",
    "SPACE",
    "NewestCheckpoint",
    "check_location",
]

REACHABLE = "checkpoint_reachable"
SPACE = "checkpoint_space"
PROBE_RETRY: dict[str, Any] = {
    "max_attempts": 6,
    "budget_s": 10.0,
    "save_budget_s": None,
    "initial_wait_s": 0.2,
    "max_wait_s": 2.0,
    "jitter_s": 0.25,
}
"""RetryPolicy of the location checks: about 5 s of backoff over 6 attempts."""
PROBE_BUDGET_S = 10.0
"""Deadline of all the location's calls together (Storage.budget): no retry starts after it."""
LIMIT_S = 40.0
"""How long the node check waits for these checks at most: the budget plus one attempt that
started just before it ends (s3fs gives up on one after 5 s to connect and 15 s to read),
and room to spare. A local filesystem that hangs (a dead NFS server) is caught by it."""


@dataclass(frozen=True, slots=True)
class NewestCheckpoint:
    """What the newest committed checkpoint's manifest records."""

    step: int
    total_bytes: int
    world_size: int


def check_location(
    url: str | None,
) -> tuple[tuple[CheckResult, CheckResult], NewestCheckpoint | None]:
    """(checkpoint_reachable, checkpoint_space) of `url`, and its newest committed checkpoint
    (None when it has none or was not reached)."""
    t0 = time.perf_counter()
    if url is None:
        why = "no checkpoint location given (--checkpoint-url)"
        return (skipped_check(REACHABLE, t0, why), skipped_check(SPACE, t0, why)), None
    threshold = (
        f"an answer within {PROBE_BUDGET_S:g} s (up to {PROBE_RETRY['max_attempts']} "
        "attempts under the storage retry policy)"
    )
    try:
        storage = Storage(url, retry=RetryPolicy(**PROBE_RETRY))
    except Exception as e:  # a URL fsspec cannot open: nothing further can be checked
        return (
            failed_check(REACHABLE, t0, "cannot be opened", threshold, _one_line(str(e))),
            skipped_check(SPACE, t0, "not checked: the location cannot be opened"),
        ), None
    with storage.budget(PROBE_BUDGET_S):
        try:
            dirs = storage.list_dirs()
        except Exception as e:  # any error that outlived the retries: not reachable
            took = time.perf_counter() - t0
            value = storage.redact(f"no answer in {took:.1f} s ({_root_cause(e)})")
            fix = _one_line(storage.redact(str(e)))
            return (
                failed_check(REACHABLE, t0, value, threshold, fix),
                skipped_check(SPACE, t0, "not checked: the location did not answer"),
            ), None
        reach = ok_check(REACHABLE, t0, f"answered in {time.perf_counter() - t0:.2f} s", threshold)
        space, newest = _space(storage, dirs)
    return (reach, space), newest


def _space(storage: Storage, dirs: list[str]) -> tuple[CheckResult, NewestCheckpoint | None]:
    t0 = time.perf_counter()
    try:
        storage.check_writable()  # a unique probe written, listed, deleted; never left behind
    except Exception as e:  # a StorageError that names the fix, or anything under it
        value = storage.redact(f"not writable ({_root_cause(e)})")
        fix = _one_line(storage.redact(str(e)))
        return failed_check(SPACE, t0, value, "a writable location", fix), None
    newest, notes = _newest(storage, dirs)
    if newest is None:
        threshold = "writable (no committed checkpoint yet to size the next one from)"
    else:
        size = fmt_bytes(newest.total_bytes)
        threshold = f"≥ {size} free: newest checkpoint step {newest.step} is {size}"
    note = "; ".join(notes)
    if storage.is_local:
        free = shutil.disk_usage(storage.root).free
        value = f"writable, {fmt_bytes(free)} free"
        if newest is not None and free < newest.total_bytes:
            fix = (
                f"free {fmt_bytes(newest.total_bytes - free)} on the filesystem of "
                f"{storage.root} (old checkpoints, other files) or point --checkpoint-url at a "
                "larger one: the next save is written whole before the oldest is deleted"
            )
            return failed_check(SPACE, t0, value, threshold, fix), newest
    elif storage.is_object_store:
        value = "writable; free space not measured: object stores have no such limit"
    else:
        value = "writable; free space not measured: this filesystem does not report it"
    return ok_check(SPACE, t0, value, threshold, note), newest


def _newest(storage: Storage, dirs: list[str]) -> tuple[NewestCheckpoint | None, list[str]]:
    """The newest checkpoint directory with a readable manifest, and notes on newer ones
    whose manifest could not be read."""
    # Imported here, not at the top: the checkpoint package loads DCP and the checkpoint
    # manager, which importing the supervisor must not (tests/test_supervisor.py).
    from resilient.checkpoint.manifest import parse_step_dir, read_manifest

    notes: list[str] = []
    steps = sorted({s for d in dirs if (s := parse_step_dir(d)) is not None}, reverse=True)
    for step in steps:
        try:
            m = read_manifest(storage, step)
        except FileNotFoundError:
            continue  # an unfinished save: no manifest yet
        except CheckpointCorruptError as e:
            notes.append(f"step {step} skipped: {_one_line(str(e))}")
            continue
        return NewestCheckpoint(m.step, m.total_bytes, m.world_size), notes
    return None, notes


def _root_cause(exc: BaseException) -> str:
    """The innermost error's type and first words (what a retry gave up on)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen and len(seen) < 16:
        seen.append(e)
        e = e.__cause__ or e.__context__
    inner = seen[-1]
    return _one_line(f"{type(inner).__name__}: {inner}")[:160]


def _one_line(text: str) -> str:
    return " ".join(text.split())
