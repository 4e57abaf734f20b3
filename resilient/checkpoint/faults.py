"""numerical_faults.json: the steps at which a run met a non-finite value, kept beside its
checkpoints so that retention keeps the newest checkpoint from before the first of them.

The runtime reports a detected numerical fault through `note_numerical_fault(step)` of its
checkpoint manager; rank 0 appends it to `<root>/numerical_faults.json`, read first and
written whole and atomically (Storage.write_bytes_atomic), so the record survives restarts
and every later run in the same location honours it. A file there that is not this record,
or that cannot be read, is an error naming the file: it is never ignored (retention would
then delete the last good checkpoint) and never overwritten.

    {"kind": "resilient.numerical_faults", "version": 1,
     "faults": [{"step": 1200, "recorded_at": 1767000000.0, "details": {...}}, ...]}
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from resilient.checkpoint.collectives import Collectives
from resilient.errors import CheckpointError
from resilient.storage import Storage

__all__ = [
    "FAULTS_NAME",
    "SUSPECT",
    "first_fault_step",
    "note_fault",
    "parse_faults",
    "read_faults",
    "record_fault",
    "suspect_steps",
    "without_suspect",
]

FAULTS_NAME = "numerical_faults.json"
SUSPECT = "saved after the last clean replica check before a replica mismatch"
"""Why a checkpoint is suspect (`ckpt.suspect_skipped`)."""
_KIND = "resilient.numerical_faults"
_VERSION = 1


def _where(storage: Storage) -> str:
    return f"{storage.url.rstrip('/')}/{FAULTS_NAME}"


def read_faults(storage: Storage) -> list[dict[str, Any]]:
    """The faults recorded under `storage`, in the order recorded ([] when none is).

    Raises CheckpointError naming the file when it is there but is not a readable record."""
    try:
        data = storage.read_bytes(FAULTS_NAME)
    except FileNotFoundError:
        return []
    return parse_faults(data, where=_where(storage))


def parse_faults(data: bytes, *, where: str) -> list[dict[str, Any]]:
    """The faults of a numerical_faults.json; CheckpointError naming `where` on any defect."""
    try:
        d = json.loads(data)
        if not isinstance(d, dict) or d.get("kind") != _KIND:
            raise ValueError(f'not resilient\'s record of numerical faults (no "kind": "{_KIND}")')
        if d.get("version") != _VERSION:
            raise ValueError(
                f"version {d.get('version')!r}, this resilient reads {_VERSION}: read it with "
                "the resilient version that wrote it"
            )
        faults = d["faults"]
        if not isinstance(faults, list):
            raise TypeError('"faults" is not a list')
        for f in faults:
            if not isinstance(f, dict) or type(f.get("step")) is not int:
                raise TypeError(f"an entry without an integer step: {f!r:.200}")
        return faults
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"{where}: unreadable record of numerical faults ({type(e).__name__}: {e}). It "
            "names the steps where training met a NaN or an infinity, and retention keeps the "
            "newest checkpoint from before the first of them; nothing was deleted or "
            "overwritten. Restore the file, or move it away if it is not resilient's (the "
            "location then counts as having had no numerical fault)"
        ) from e


def record_fault(storage: Storage, step: int, details: dict[str, Any]) -> list[dict[str, Any]]:
    """Append a fault at `step` to the record under `storage`; every fault recorded now.

    The record is read first: one that cannot be read raises (read_faults) and is left as
    it is."""
    faults = read_faults(storage)
    faults.append({"step": int(step), "recorded_at": time.time(), "details": dict(details)})
    body = {"kind": _KIND, "version": _VERSION, "faults": faults}
    # default=repr: a detail that JSON cannot hold (a tensor, a path) is kept as its repr
    storage.write_bytes_atomic(FAULTS_NAME, json.dumps(body, indent=1, default=repr).encode())
    return faults


def suspect_steps(faults: list[dict[str, Any]]) -> dict[int, float]:
    """Steps whose checkpoints a fault made suspect (a replica mismatch: saved after the last
    clean replica check), each with when the newest such fault was recorded. A checkpoint of
    that step committed before then may hold the corruption; one committed after is a
    replay's, checked anew."""
    out: dict[int, float] = {}
    for f in faults:
        details = f.get("details") or {}
        for step in details.get("suspect") or () if isinstance(details, dict) else ():
            if isinstance(step, int):
                out[step] = max(out.get(step, 0.0), float(f.get("recorded_at") or 0.0))
    return out


def without_suspect(
    storage: Storage, steps: list[int], manifest: Callable[[int], Any]
) -> tuple[list[int], list[int]]:
    """(`steps` that may be loaded, the suspect ones): a step is suspect when a fault named
    it and its checkpoint (`manifest(step).created_at`) was committed before that fault was
    recorded."""
    marked = suspect_steps(read_faults(storage)) if steps else {}
    suspect = [s for s in steps if s in marked and manifest(s).created_at < marked[s]]
    return [s for s in steps if s not in suspect], suspect


def first_fault_step(faults: list[dict[str, Any]]) -> int | None:
    """The lowest step among `faults` (the first fault of the run), None when there is none."""
    return min((int(f["step"]) for f in faults), default=None)


def note_fault(
    storage: Storage, collectives: Collectives, step: int, details: dict[str, Any], log: Any
) -> int:
    """Rank 0 records a fault at `step` under `storage`; every rank gets the first fault step
    recorded there, or the error (a collective over `collectives`)."""
    first = collectives.agree(lambda: first_fault_step(record_fault(storage, step, details)))
    assert first is not None
    log.warning(
        "ckpt.numerical_fault.noted",
        step=step,
        first_fault=first,
        file=_where(storage),
        details=details,
    )
    return first
