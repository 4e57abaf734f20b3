"""Loader workers outlive a preemption signal, so the rank can still reach its agreed stop.

torch elastic stops a worker with `os.killpg`: the signal reaches the whole process group,
the rank's DataLoader worker processes included. torch's worker loop installs a SIGTERM
handler of its own that exits quietly when the parent sent the signal and otherwise dies of
it, and SIGUSR1 kills a process by default. Either way the workers were gone before the
ranks agreed on a stop step (the agreement runs about once a second), and the rank's next
`next(batches)` failed with "DataLoader worker exited unexpectedly" instead of saving
(docs/internals.md#g-loader-workers-and-preemption).

`shield_workers()` wraps the tracked loader's `worker_init_fn`, which the worker calls after
torch's handlers are installed. In a worker, the preemption signals are blocked and a thread
reads them with `sigwaitinfo`, which tells who sent each one (a Python signal handler cannot):
- sent by the rank itself (the loader's or multiprocessing's `terminate()` at shutdown): the
  worker exits at once, as torch's own handler does;
- sent by anyone else (the launcher's killpg) while the rank lives: ignored;
- the rank is gone: the worker exits.
The launcher's SIGKILL at the end of the grace period reaches the workers as before.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["shield_workers"]


def shield_workers(loader: Any, signals: Iterable[signal.Signals]) -> None:
    """Make `loader`'s worker processes ignore `signals` while their rank lives.

    A loader without worker processes, or with no signals to shield, is left as it is. The
    user's own `worker_init_fn` still runs, after ours. A loader tracked again has the
    runtime's wrappers peeled off first (runtime/wiring.py `peel_worker_init`)."""
    sigs = tuple(int(s) for s in signals)
    if not sigs or getattr(loader, "num_workers", 0) == 0:
        return
    loader.worker_init_fn = _ShieldedInit(sigs, getattr(loader, "worker_init_fn", None))


class _ShieldedInit:
    """A picklable worker_init_fn (spawn and forkserver loaders pickle it)."""

    resilient_wrapper = True
    """The runtime peels its wrappers off before wrapping again (a loader tracked twice)."""

    def __init__(self, signals: tuple[int, ...], inner: Callable[[int], Any] | None) -> None:
        self.signals = signals
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        sigs = set(self.signals)
        # blocked before the thread starts, so it inherits the mask and only sigwaitinfo sees them
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        threading.Thread(
            target=_serve_signals,
            args=(os.getppid(), sigs),
            name="resilient-loader-signals",
            daemon=True,
        ).start()
        if self.inner is not None:
            self.inner(worker_id)


def _serve_signals(rank_pid: int, sigs: set[int]) -> None:
    while True:
        info = signal.sigwaitinfo(sigs)
        if info.si_pid == rank_pid or os.getppid() != rank_pid:
            os._exit(0)  # the rank stops its workers, or it is gone: nothing is left to serve
