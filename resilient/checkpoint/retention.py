"""Which checkpoint directories exist under a root, and deleting the ones no longer kept.

A directory `step_<N>` is a checkpoint once its manifest exists; without one it is an
unfinished save. After each commit, rank 0 deletes committed checkpoints beyond `keep_last`
and unfinished saves older than the newest checkpoint. Deletion removes the manifest first,
so that an interrupted one never leaves a committed checkpoint with files missing.

Once a numerical fault is recorded in the location (faults.py), the newest committed
checkpoint from before the first recorded fault is kept as well, beyond `keep_last`: the
checkpoints after it are finite (finite.py), but may hold a model the fault harmed in ways a
check of values cannot see; the one before it is the last known to predate it.
"""

from __future__ import annotations

from typing import Any

from resilient.checkpoint.config import CheckpointInfo
from resilient.checkpoint.faults import first_fault_step, read_faults
from resilient.checkpoint.manifest import MANIFEST_NAME, parse_step_dir, step_dir
from resilient.storage import Storage

__all__ = ["delete_checkpoint", "list_checkpoints", "retain", "retain_logged"]


def list_checkpoints(storage: Storage) -> list[CheckpointInfo]:
    """Checkpoint directories under the root, oldest first. Foreign names are ignored."""
    infos = []
    for name in storage.list_dirs():
        step = parse_step_dir(name)
        if step is not None:
            committed = storage.exists(f"{name}/{MANIFEST_NAME}")
            infos.append(CheckpointInfo(step=step, committed=committed))
    return sorted(infos, key=lambda i: i.step)


def delete_checkpoint(storage: Storage, rel: str) -> None:
    """Delete checkpoint directory `rel`, its manifest first: a deletion cut short (a
    kill, a storage error) leaves an unfinished save, which loads skip and retention
    finishes later, never a committed checkpoint with files missing."""
    storage.remove_file(f"{rel}/{MANIFEST_NAME}")
    storage.remove_tree(rel)


def retain_logged(
    storage: Storage,
    keep_last: int,
    just_committed: int,
    log: Any,
    *,
    said: set[int] | None = None,
) -> None:
    """`retain`; a failure is logged, never raised: the checkpoint is committed, and what
    was not deleted is deleted next time."""
    try:
        retain(storage, keep_last, just_committed, log, said=said)
    except Exception as e:  # storage errors, an unreadable listing or faults record alike
        log.warning("ckpt.retention.failed", step=just_committed, error=storage.redact(str(e)))


def retain(
    storage: Storage,
    keep_last: int,
    just_committed: int,
    log: Any,
    *,
    said: set[int] | None = None,
) -> None:
    """Delete committed checkpoints beyond keep_last and torn saves older than the newest.

    The checkpoint just written is always kept: newer committed ones may exist that failed
    verification (a run resumed from an older checkpoint), and they must not push out the
    newest one known to be valid. So is the newest committed checkpoint from before the
    first numerical fault recorded here (`ckpt.retention.keep_good`, logged once for each
    step kept that way: `said` holds the steps already logged). A record of faults that
    cannot be read raises before anything is deleted.
    """
    first_fault = first_fault_step(read_faults(storage))
    infos = list_checkpoints(storage)
    committed = [i.step for i in infos if i.committed]
    if not committed:
        return
    keep = set(committed[-keep_last:]) | {just_committed}
    # checkpoint N holds the state after N steps: N <= F is from before step F ran
    good = [s for s in committed if first_fault is not None and s <= first_fault]
    if good and good[-1] not in keep:
        keep.add(good[-1])
        if said is None or good[-1] not in said:
            log.info(
                "ckpt.retention.keep_good",
                step=good[-1],
                first_fault=first_fault,
                keep_last=keep_last,
                note="the newest checkpoint from before the first numerical fault is kept",
            )
            if said is not None:
                said.add(good[-1])
    newest = committed[-1]
    for info in infos:
        if info.step in keep:
            continue
        if info.committed:
            reason = f"beyond keep_last={keep_last}"
        elif info.step < newest:
            reason = "unfinished save older than the newest checkpoint"
        else:
            continue  # may be a save in flight elsewhere: never touched
        delete_checkpoint(storage, step_dir(info.step))
        log.info("ckpt.retention.delete", step=info.step, reason=reason)
