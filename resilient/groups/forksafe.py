"""Fork safety: what a process forked from a rank inherits of the runtime, made inert.

A rank forks whenever a DataLoader with workers starts an epoch (the default start method on
Linux is fork), and a user's code may fork too. The child is a copy of the rank with only the
forking thread; it must not act as the rank. Registered objects get `_after_fork_child()`
called in the child (os.register_at_fork): the watchdog forgets its thread and store (the
child publishes no heartbeat, writes no verdict, and its atexit hook does not mark the rank
closed). The event log's own lock is handled in resilient/log.py, which holds it across fork.
The preemption handlers are deliberately inherited: the launcher signals the rank's whole
process group, and a DataLoader worker that died of that SIGTERM would take its rank down
before the agreed stop (preempt/watch.py).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Protocol

__all__ = ["ForkAware", "after_fork_in_child"]


class ForkAware(Protocol):
    def _after_fork_child(self) -> None: ...


_objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def after_fork_in_child(obj: ForkAware) -> None:
    """Call `obj._after_fork_child()` in every process forked from this one (while `obj`
    lives). Idempotent."""
    _objects.add(obj)


def _run_child_hooks() -> None:
    for obj in list(_objects):
        with contextlib.suppress(Exception):  # a hook must never break the child's work
            obj._after_fork_child()
    _objects.clear()  # a grandchild forked from the child has nothing of the rank left


os.register_at_fork(after_in_child=_run_child_hooks)
