"""Which checkpoint directories exist under a root, and deleting the ones no longer kept.

A directory `step_<N>` is a checkpoint once its manifest exists; without one it is an
unfinished save. After each commit, rank 0 deletes committed checkpoints beyond `keep_last`
and unfinished saves older than the newest checkpoint. Deletion removes the manifest first,
so that an interrupted one never leaves a committed checkpoint with files missing.
"""

from __future__ import annotations

from typing import Any

from resilient.checkpoint.config import CheckpointInfo
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


def retain_logged(storage: Storage, keep_last: int, just_committed: int, log: Any) -> None:
    """`retain`; a failure is logged, never raised: the checkpoint is committed, and what
    was not deleted is deleted next time."""
    try:
        retain(storage, keep_last, just_committed, log)
    except Exception as e:  # storage errors, and an unreadable listing alike
        log.warning("ckpt.retention.failed", step=just_committed, error=storage.redact(str(e)))


def retain(storage: Storage, keep_last: int, just_committed: int, log: Any) -> None:
    """Delete committed checkpoints beyond keep_last and torn saves older than the newest.

    The checkpoint just written is always kept: newer committed ones may exist that failed
    verification (a run resumed from an older checkpoint), and they must not push out the
    newest one known to be valid.
    """
    infos = list_checkpoints(storage)
    committed = [i.step for i in infos if i.committed]
    if not committed:
        return
    keep = set(committed[-keep_last:]) | {just_committed}
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
