"""`LiveMonitor`: the supervisor's live view of its run, its metrics endpoint and status line.

One daemon thread polls the event logs every `poll_s` (EventFollower), folds the new events
into the LiveState, recomputes the goodput when due (GoodputTracker) and redraws the status
line. The metrics server answers scrapes from the state under the same lock. Nothing of it
runs in the workers: they report through the event logs they write anyway.

It takes the operating options as any object with `metrics_port`, `metrics_addr`, `status`
and `status_every_s` (the supervisor's OpsConfig), and imports nothing of the supervisor.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from resilient.live.follow import EventFollower
from resilient.live.goodput import GoodputTracker
from resilient.live.metrics import LiveCollector, MetricsServer
from resilient.live.state import LiveState
from resilient.live.status import StatusLine, run_status

__all__ = ["LiveMonitor", "OpsLike"]

METRICS_SERVING = "metrics.serving"
"""The metrics endpoint is up: port (the actual one), addr."""
LIVE_STOPPED = "live.stopped"
"""The monitor's own cost at its close: cpu_s (its thread's polls and the scrapes), polls,
scrapes, bytes_read, goodput_s (the last goodput analysis)."""


class OpsLike(Protocol):
    @property
    def metrics_port(self) -> int | None: ...
    @property
    def metrics_addr(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def status_every_s(self) -> float: ...


class LiveMonitor:
    def __init__(
        self,
        run_dir: str,
        ops: OpsLike,
        stream: TextIO | None = None,
        *,
        log: Any = None,
        poll_s: float = 1.0,
        goodput_every_s: float = 10.0,
        host: str | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.ops = ops
        self._log = log
        """Where `metrics.serving` and `live.stopped` go: anything with .info/.warning (the
        supervisor's EventLog); None: warnings to stderr, nothing else."""
        self._poll_s = poll_s
        self._lock = threading.RLock()
        self._polling = threading.Lock()  # the thread's polls and close()'s last one
        self.state = LiveState(host=socket.gethostname() if host is None else host)
        self.follower = EventFollower(Path(run_dir) / "logs")
        self.goodput = GoodputTracker(every_s=goodput_every_s)
        self.status = StatusLine(
            stream, mode=ops.status, every_s=ops.status_every_s, prefix="resilient: "
        )
        self._server: MetricsServer | None = None
        self._collector: LiveCollector | None = None
        self.cpu_s = 0.0
        """CPU seconds of the monitor's thread (polls, goodput, status)."""
        self.polls = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failed = False

    @property
    def port(self) -> int | None:
        """The port the metrics are served on (None: not served)."""
        return None if self._server is None else self._server.port

    def start(self) -> LiveMonitor:
        if self.ops.metrics_port is not None:
            collector = LiveCollector(self.state, self._lock, lambda: self.goodput.last)
            try:
                self._server = MetricsServer(
                    collector, port=self.ops.metrics_port, addr=self.ops.metrics_addr
                )
                self._collector = collector
            except OSError as e:  # taken since it was checked: the run goes on without them
                self._say("warning", "metrics.failed", port=self.ops.metrics_port, error=str(e))
            else:
                self._say(
                    "info", METRICS_SERVING, port=self._server.port, addr=self.ops.metrics_addr
                )
        self.status.own_stderr()
        self._thread = threading.Thread(target=self._run, name="resilient-live", daemon=True)
        self._thread.start()
        return self

    def poll(self) -> None:
        """Read what is new, fold it in, redraw the status when due (the thread's round)."""
        with self._polling:
            self._fold(final=False)
        self.status.show(self.status_text())

    def _fold(self, *, final: bool) -> None:
        events = self.follower.poll()
        with self._lock:
            self.state.apply_all(events)
        self.goodput.add(events)
        self.goodput.update(force=final)

    def status_text(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        s = self.state
        with self._lock:
            g = self.goodput.last
            return run_status(
                step=s.lead_step(),
                total=s.total_steps,
                rate=s.steps_per_second(),
                checkpoint_step=s.checkpoint_step,
                checkpoint_age_s=None if s.checkpoint_t is None else now - s.checkpoint_t,
                goodput=g.goodput if g else None,
                recoveries=dict(s.recoveries),
                ranks=s.world_size or 0,
            )

    def close(self) -> None:
        """Stop the thread, fold in the last events, print the final status, stop serving.
        Never raises: the run's own outcome is what its caller reports."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        text = None
        try:
            if self._polling.acquire(timeout=10):
                try:
                    self._fold(final=True)
                finally:
                    self._polling.release()
            text = self.status_text()
        except Exception as e:
            self._say("warning", "live.error", error=f"{type(e).__name__}: {e}")
        self.status.close(text)
        if self._server is not None:
            try:
                self._server.close()
            except OSError as e:
                self._say("warning", "live.error", error=f"{type(e).__name__}: {e}")
        c = self._collector
        self._say(
            "info",
            LIVE_STOPPED,
            cpu_s=round(self.cpu_s + (c.cpu_s if c else 0.0), 4),
            polls=self.polls,
            scrapes=c.scrapes if c else 0,
            bytes_read=self.follower.bytes_read,
            goodput_s=round(self.goodput.cost_s, 4),
        )

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            t0 = time.thread_time()
            try:
                self.poll()
            except Exception as e:  # the run goes on without its live view
                if not self._failed:
                    self._failed = True
                    self._say("warning", "live.error", error=f"{type(e).__name__}: {e}")
            self.cpu_s += time.thread_time() - t0
            self.polls += 1

    def _say(self, level: str, event: str, **fields: Any) -> None:
        if self._log is not None:
            getattr(self._log, level)(event, **fields)
        elif level != "info":  # without an event log, only what went wrong is said
            print(f"resilient: {event} {fields}", file=sys.stderr)
