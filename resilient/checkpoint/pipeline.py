"""What runs beside training for CheckpointManager: its save thread, DCP's stager, and the
futures of the save in flight.

An async save copies the tensors through the stager (pinned memory and non-blocking copies
where CUDA is), then writes and commits on the save thread; a blocking save's retention runs
on that thread too. Every later call (`wait`, the next save, a load, `close`) first waits
here, so at most one save and its retention are ever in flight.

While the stager copies, the live tensors must not change (pytorch#144657: DCP's own async
save leaves that to its caller, and an update that lands mid-copy tears the checkpoint). So
the first async save of a model and optimizer fences them (`fence`): hooks that make
`optimizer.step()` (parameters, optimizer state) and the model's forward (buffers: BatchNorm
statistics, DDP's buffer broadcast) wait for the copy first. The forward is fenced even in a
model without buffers: an optimizer made after the save (a loop that replaces its optimizer)
has no hook of its own until the next save, and its first step comes after a forward. A
caller who changes tensors by other means (an in-place edit of a parameter) calls
`wait_staged()` before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from resilient.checkpoint._torch_compat import keep_stager_usable

__all__ = ["SavePipeline"]


class SavePipeline:
    """One save thread and one stager, both created on first use, and what they run."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._stager: DefaultStager | None = None
        self._staged: Future[Any] | None = None
        self._pending: Future[int | None] | None = None
        self._retention: Future[None] | None = None
        self._fenced: dict[int, tuple[weakref.ref[Any], Any]] = {}
        """id of each fenced model or optimizer -> (a reference to it, its hook's handle)."""

    def start_threads(self) -> None:
        """Start the save's and the stager's threads now: started by the first save, each
        took the GIL from the loop for up to a switch interval (5 ms) while starting."""
        self._get_executor().submit(lambda: None).result()
        started = self._get_stager().stage({})
        if isinstance(started, Future):
            started.result()

    def stage(self, tensors: dict[str, Any], *, fence: tuple[Any, Any]) -> Future[Any]:
        """Start copying `tensors` away from the live ones; the copies, once done. `fence`:
        the (model, optimizer) they come from, fenced first (`fence`; None where absent)."""
        self.fence(*fence)
        staged = self._get_stager().stage(tensors)
        if not isinstance(staged, Future):  # synchronous stager: already a copy
            done: Future[Any] = Future()
            done.set_result(staged)
            staged = done
        self._staged = staged
        return staged

    def fence(self, model: Any, optimizer: Any) -> None:
        """Make `optimizer.step()` and `model`'s forward wait for the staging in flight (the
        module's docstring), once per object; the hooks go at `close()`. Each costs a call a
        step that returns at once when nothing is being staged."""
        me = weakref.ref(self)  # the hooks must not keep a closed pipeline alive

        def wait(*_: Any) -> None:
            pipeline = me()
            if pipeline is not None:
                pipeline.wait_staged()

        for obj in (model, optimizer):
            if obj is None:
                continue
            known = self._fenced.get(id(obj))
            if known is not None and known[0]() is obj:
                continue
            if obj is optimizer:
                handle = optimizer.register_step_pre_hook(wait)
            else:
                handle = model.register_forward_pre_hook(wait)
            self._fenced[id(obj)] = (weakref.ref(obj), handle)

    def submit(self, job: Callable[..., int | None], *args: Any) -> None:
        """Run the save `job(*args)` (its committed step, or None) on the save thread."""
        self._pending = self._get_executor().submit(job, *args)

    def submit_retention(self, job: Callable[[], None]) -> None:
        """Run a blocking save's retention on the save thread; `job` must not raise."""
        self._retention = self._get_executor().submit(job)

    def wait_staged(self) -> None:
        """Block until the in-flight async save no longer reads live tensors."""
        staged = self._staged
        if staged is not None:
            staged.result()
            self._staged = None

    def wait(self) -> int | None:
        """Wait for the in-flight save and its retention; return its committed step. Raises
        the save's error, if any."""
        pending, self._pending = self._pending, None
        self.wait_staged()
        try:
            return None if pending is None else pending.result()
        finally:
            retention, self._retention = self._retention, None
            if retention is not None:
                retention.result()  # never raises: retention.retain_logged logs instead

    def settle(self) -> None:
        """Block until the save in flight and its retention are done, leaving the save's
        outcome (its error) to `wait()`: what a collective of the training thread waits for
        on the manager's group, where the save's thread runs collectives too."""
        running: list[Future[Any]] = [f for f in (self._pending, self._retention) if f]
        if running:
            wait_futures(running)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        """Wait for the in-flight save and release threads and staging buffers."""
        try:
            self.wait()
        finally:
            for _, handle in self._fenced.values():
                handle.remove()
            self._fenced.clear()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _get_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-ckpt")
        return self._executor

    def _get_stager(self) -> DefaultStager:
        if self._stager is None:
            # Background staging works on CPU and GPU; pinned memory and non-blocking copies
            # need an accelerator, so they are on only where CUDA is.
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
            self._stager = keep_stager_usable(DefaultStager(options))
        return self._stager
