"""This host's memory: /dev/shm for the DataLoader workers, RAM for in-memory snapshots.

shm. A DataLoader worker hands each batch to its rank through shared memory, so /dev/shm
holds every batch in flight: num_workers x prefetch_factor per rank. Each rank logs its
loader's num_workers at track() (`data.loader`); when the newest attempt's say no loader runs
worker processes, nothing is needed and the check is skipped. Otherwise (workers, or no
attempt has told yet) the need is a floor per local rank, SHM_PER_RANK (256 MiB: 4 workers x
2 prefetched batches of 32 MiB, about a batch of 32 images at 3x224x224 in float32 with its
collated copy). It catches the common fault, a container's 64 MiB default or a /dev/shm
filled by processes that died, without keeping out a modest but working one.

host_memory. With in-memory snapshots on (resilient/memory/snapshot.py), each rank holds
`copies` buffers of its share of the state in host memory, and refuses to start when they
would take more than memory_fraction of the memory available. The size per rank comes from
the workers' own `snapshot.memory` events in <run_dir>/logs: the largest that a rank logged
in the newest attempt that logged any (what it measured, copies included). Only the head and
the tail of the most recent logs are read (LOG_HEAD, LOG_TAIL, MAX_LOGS): every attempt logs
the event as it starts, so the first attempt's is in the head and a recent one's in the
tail, and their sizes differ only when the world size did. Before any attempt took a
snapshot, $RESILIENT_SNAPSHOT (which the workers inherit) says whether they are on, and the
newest checkpoint's manifest sizes them: its bytes over the world size that wrote it, times
two copies. That is a floor: exact for sharded (FSDP2) state, while a DDP rank holds the
whole state. The node needs nproc_per_node times that, within memory_fraction of the memory
available now; failing that here, the workers would fail the same rule (or meet the OOM
killer) with less memory free, their own already taken.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from resilient import events as ev
from resilient.envvars import ENV_SNAPSHOT, json_object_env
from resilient.errors import ConfigError
from resilient.health.report import MIB, CheckResult, failed_check, fmt_bytes, ok_check
from resilient.health.report import skipped_check as skipped
from resilient.health.storage import NewestCheckpoint

__all__ = ["SHM_PATH", "SHM_PER_RANK", "SNAPSHOT_MEMORY", "check_host_memory", "check_shm"]

SHM_PATH = "/dev/shm"
SHM_PER_RANK = 256 * MIB
"""The floor of shared memory per local rank (see the module doc)."""
DATA_LOADER = "data.loader"
"""Logged by each rank at track(): its loader's num_workers, prefetch_factor, batch_size."""
SNAPSHOT_MEMORY = "snapshot.memory"
"""Logged by each rank at track() (bytes_per_copy, copies, total_bytes), and again when a
snapshot turned out larger (bytes_per_copy, copies, measured)."""
LOG_HEAD, LOG_TAIL, MAX_LOGS = 1 * MIB, 4 * MIB, 32
"""What is read of the workers' logs: the first and last bytes of each of the most recently
written ones. A week of one rank's events is about 100 MiB, and a shared run directory holds
every node's: reading them whole would cost seconds each round."""
MEMORY_FRACTION = 0.5
"""SnapshotConfig.memory_fraction's default: the share of available memory snapshots may take."""
_ON = {"1", "on", "true"}


def check_shm(nproc_per_node: int, run_dir: str | None = None) -> CheckResult:
    """The floor per local rank, unless the newest attempt's `data.loader` events say no
    loader runs worker processes (then nothing is needed). Before any attempt told, the
    floor applies."""
    t0 = time.perf_counter()
    if not os.path.isdir(SHM_PATH):
        return skipped("shm", t0, f"no {SHM_PATH} on this machine")
    workers = _loader_workers(run_dir)
    if workers == 0:
        why = "the loaders run no worker processes (data.loader: num_workers 0): no batch passes"
        return skipped("shm", t0, f"{why} through {SHM_PATH}")
    usage = shutil.disk_usage(SHM_PATH)
    need = SHM_PER_RANK * nproc_per_node
    value = f"{fmt_bytes(usage.free)} free of {fmt_bytes(usage.total)}"
    threshold = (
        f"≥ {fmt_bytes(need)} free: {nproc_per_node} local rank(s) x {fmt_bytes(SHM_PER_RANK)} "
        "for DataLoader batches in flight"
    )
    if usage.free < need:
        fix = (
            f"give {SHM_PATH} more room (docker run --shm-size=8g or --ipc=host; on Kubernetes "
            "an emptyDir with medium: Memory mounted there), or remove what dead processes left "
            "in it; a loader without worker processes needs none (--no-health-check until its "
            "first attempt has said so)"
        )
        return failed_check("shm", t0, value, threshold, fix)
    return ok_check("shm", t0, value, threshold)


def check_host_memory(
    run_dir: str, nproc_per_node: int, newest: Callable[[], NewestCheckpoint | None]
) -> CheckResult:
    """`newest` gives the newest committed checkpoint (waiting for the location check); it is
    called only when no earlier attempt logged the snapshots' size."""
    t0 = time.perf_counter()
    setting = _snapshot_setting()
    logged = _logged_per_rank(run_dir)
    if logged is not None:
        per_rank, source = logged
    elif setting is None:
        why = (
            "in-memory snapshots off or unknown: no snapshot.memory event in the run's logs, "
            f"${ENV_SNAPSHOT} does not turn them on"
        )
        return skipped("host_memory", t0, why)
    else:
        ckpt = newest()
        if ckpt is None:
            why = (
                f"in-memory snapshots on (${ENV_SNAPSHOT}) but of unknown size: no attempt "
                "logged it yet and no committed checkpoint records the state's size"
            )
            return skipped("host_memory", t0, why)
        per_rank = 2 * math.ceil(ckpt.total_bytes / max(1, ckpt.world_size))
        source = (
            f"2 copies of checkpoint step {ckpt.step}'s {fmt_bytes(ckpt.total_bytes)} over the "
            f"{ckpt.world_size} rank(s) that wrote it, a floor"
        )
    fraction = _fraction(setting or {})
    need = per_rank * nproc_per_node
    avail = int(psutil.virtual_memory().available)
    value = f"{fmt_bytes(avail)} available"
    threshold = (
        f"≥ {fmt_bytes(need / fraction)} available: {nproc_per_node} local rank(s) x "
        f"{fmt_bytes(per_rank)} of snapshot buffers ({source}) = {fmt_bytes(need)}, at most "
        f"memory_fraction {fraction:g} of it"
    )
    if need > fraction * avail:
        fix = (
            "free host memory on this node (other jobs, leftover processes), spread the state "
            f"over more ranks, or turn snapshots off ({ENV_SNAPSHOT}=0, or snapshot="
            "{'enabled': False} in resilient.init)"
        )
        return failed_check("host_memory", t0, value, threshold, fix)
    return ok_check("host_memory", t0, value, threshold)


def _newest_attempt(
    run_dir: str, name: str, usable: Callable[[dict[str, Any]], bool] = lambda e: True
) -> list[dict[str, Any]]:
    """The `usable` events called `name` of the newest attempt that logged one (within what
    _windows reads of the most recent rank logs); [] when none did."""
    logs = [p for p in (Path(run_dir) / "logs").glob("rank*.jsonl") if p.is_file()]
    logs = sorted(logs, key=_mtime, reverse=True)[:MAX_LOGS]
    found = [e for p in logs for w in _windows(p) for e in _named(w, name) if usable(e)]
    if not found:
        return []
    newest = max(found, key=_when)
    attempt = (newest.get("run_id"), newest.get("restart"))
    return [e for e in found if (e.get("run_id"), e.get("restart")) == attempt]


def _logged_per_rank(run_dir: str) -> tuple[int, str] | None:
    """(bytes, where from): the largest snapshot buffers one rank held in the newest attempt
    that logged snapshot.memory; None when none did."""
    same = _newest_attempt(run_dir, SNAPSHOT_MEMORY, lambda e: _held_bytes(e) is not None)
    if not same:
        return None
    most = max(same, key=lambda e: _held_bytes(e) or 0)
    return _held_bytes(
        most
    ) or 0, f"rank {most.get('rank')} logged it in restart {most.get('restart')}"


def _loader_workers(run_dir: str | None) -> int | None:
    """The most worker processes any rank's loader ran in the newest attempt that logged
    `data.loader`; None when none did (or no run directory)."""
    same = _newest_attempt(run_dir, DATA_LOADER) if run_dir is not None else []
    return max((int(e.get("num_workers") or 0) for e in same), default=None)


def _windows(path: Path) -> list[bytes]:
    """The first LOG_HEAD and the last LOG_TAIL bytes of a log (all of a smaller one). A
    line cut at a window's edge does not parse and is skipped."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= LOG_HEAD + LOG_TAIL:
                return [f.read()]
            head = f.read(LOG_HEAD)
            f.seek(size - LOG_TAIL)
            return [head, f.read(LOG_TAIL)]
    except OSError:  # removed under us, or unreadable: nothing to learn from it
        return []


def _named(data: bytes, name: str) -> list[dict[str, Any]]:
    """The events called `name` in `data` (lines of JSON). Only the lines that mention it are
    parsed: the others are most of a log."""
    needle = f'"{name}"'.encode()
    lines: list[bytes] = []
    at = data.find(needle)
    while at >= 0:
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        end = len(data) if end < 0 else end
        lines.append(data[start:end])
        at = data.find(needle, end)
    return [e for e in ev.parse_lines(b"\n".join(lines)) if e.get("event") == name]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _held_bytes(e: dict[str, Any]) -> int | None:
    """Host memory one rank's snapshots held, from one snapshot.memory event."""
    total, each, copies = e.get("total_bytes"), e.get("bytes_per_copy"), e.get("copies", 2)
    if isinstance(total, int) and total >= 0:
        return total
    if isinstance(each, int) and isinstance(copies, int) and each >= 0 and copies > 0:
        return each * copies
    return None


def _when(e: dict[str, Any]) -> float:
    try:
        return ev.timestamp(e)
    except (KeyError, ValueError, TypeError):
        return float("-inf")


def _snapshot_setting() -> dict[str, Any] | None:
    """$RESILIENT_SNAPSHOT's fields when it turns snapshots on, as SnapshotConfig.from_env
    reads it; None otherwise (unset, off, or unreadable: the workers say why)."""
    if os.environ.get(ENV_SNAPSHOT, "").strip().lower() in _ON:
        return {}
    try:
        fields = json_object_env(ENV_SNAPSHOT)
    except ConfigError:
        return None
    return fields if fields.get("enabled") is True else None


def _fraction(fields: dict[str, Any]) -> float:
    value = fields.get("memory_fraction", MEMORY_FRACTION)
    ok = isinstance(value, int | float) and 0 < value <= 1
    return float(value) if ok else MEMORY_FRACTION
