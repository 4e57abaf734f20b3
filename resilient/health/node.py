"""check_node: every check of this node at once, each event logged, one verdict.

The checks that wait on something outside this process (the checkpoint location, NVML, the
user's command) run in threads of their own, at the same time; shm and host memory run here.
Each thread has a time limit: a check still running past it (a hung NFS mount, an NVML call
that never returns) fails, saying so, and its thread is left behind as a daemon, so neither
the verdict nor the supervisor's exit waits for it.

A check that raises something unexpected fails with the error: the node is not trusted on a
check that could not be made (--no-health-check turns the built-in ones off).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from resilient import events as ev
from resilient.health import command, gpu, host, storage
from resilient.health.report import CheckResult, HealthInputs, HealthReport, failed_check

__all__ = ["GPU_LIMIT_S", "check_node"]

GPU_LIMIT_S = 15.0
"""NVML answers in milliseconds; a GPU that has fallen off the bus can take it seconds."""


class _Job:
    """One check (or a pair) in a daemon thread, with a deadline."""

    def __init__(
        self, names: Sequence[str], fn: Callable[[], Sequence[CheckResult]], limit_s: float
    ) -> None:
        self.names = tuple(names)
        self.limit_s = limit_s
        self.t0 = time.perf_counter()
        self._fn = fn
        self._out: tuple[CheckResult, ...] | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"health-{names[0]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = tuple(self._fn())
        except Exception as e:  # a failed check, not a crashed supervisor
            self._out = tuple(_crashed(n, self.t0, e) for n in self.names)
        finally:
            self._done.set()

    def results(self) -> tuple[CheckResult, ...]:
        """The results, waiting until the deadline; past it, each check fails as hung."""
        left = self.limit_s - (time.perf_counter() - self.t0)
        if self._done.wait(max(0.0, left)) and self._out is not None:
            return self._out
        return tuple(
            failed_check(
                n,
                self.t0,
                f"no result within {self.limit_s:g} s",
                f"a result within {self.limit_s:g} s",
                "something this check waits on hangs on this node (storage mount, driver, or "
                "the command's own wait): find it, or run with --no-health-check",
            )
            for n in self.names
        )


def check_node(inputs: HealthInputs, log: Any) -> HealthReport:
    """Run every check of this node; log one `health.check` per check and one `health.done`.

    `log` has .info(event, **fields) and .warning(event, **fields) (resilient.log.EventLog).
    """
    t0 = time.perf_counter()
    if not inputs.builtin:
        user_only = command.check_command(inputs.user_cmd, inputs.user_timeout_s)
        return _logged(HealthReport(checks=(user_only,), seconds=time.perf_counter() - t0), log)
    newest: list[storage.NewestCheckpoint | None] = [None]

    def location() -> tuple[CheckResult, ...]:
        results, newest[0] = storage.check_location(inputs.checkpoint_url)
        return results

    where = _Job((storage.REACHABLE, storage.SPACE), location, storage.LIMIT_S)
    gpus = _Job(("gpu",), lambda: (gpu.check_gpus(),), GPU_LIMIT_S)
    user = _Job(
        ("user_command",),
        lambda: (command.check_command(inputs.user_cmd, inputs.user_timeout_s),),
        inputs.user_timeout_s + 3 * command.KILL_WAIT_S + 1.0,  # its kill and drain, and spare
    )

    def newest_checkpoint() -> storage.NewestCheckpoint | None:
        where.results()  # waits for the location check, or its deadline
        return newest[0]

    here = [
        _guarded("shm", lambda: host.check_shm(inputs.nproc_per_node, inputs.run_dir)),
        _guarded(
            "host_memory",
            lambda: host.check_host_memory(
                inputs.run_dir, inputs.nproc_per_node, newest_checkpoint
            ),
        ),
    ]
    checks = (*where.results(), *here, *gpus.results(), *user.results())
    return _logged(HealthReport(checks=checks, seconds=time.perf_counter() - t0), log)


def _logged(report: HealthReport, log: Any) -> HealthReport:
    """Log one `health.check` per check and the round's `health.done`; returns `report`."""
    for c in report.checks:
        (log.info if c.ok else log.warning)(
            ev.HEALTH_CHECK,
            name=c.name,
            ok=c.ok,
            skipped=c.skipped,
            value=c.value,
            threshold=c.threshold,
            seconds=round(c.seconds, 4),
            **({"detail": c.detail} if c.detail else {}),
        )
    (log.info if report.ok else log.warning)(
        ev.HEALTH_DONE,
        ok=report.ok,
        seconds=round(report.seconds, 4),
        failed=[c.name for c in report.failed],
    )
    return report


def _guarded(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # a failed check, not a crashed supervisor
        return _crashed(name, t0, e)


def _crashed(name: str, t0: float, e: Exception) -> CheckResult:
    return failed_check(
        name,
        t0,
        f"the check raised {type(e).__name__}: {' '.join(str(e).split())[:300]}",
        "a check that completes",
        "the node could not be checked: the error says why (--no-health-check skips the "
        "built-in checks)",
    )
