"""The run's live state as Prometheus metrics (docs/metrics.md lists them all).

A custom Collector on a private CollectorRegistry: every scrape builds the families from the
monitor's LiveState under its lock, so nothing is updated per event and the workers do no
work for the metrics. `MetricsServer` serves the registry over HTTP (prometheus_client's
threaded server); port 0 asks the OS for a free port, and `.port` says which it got.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from resilient.live.goodput import Goodput
from resilient.live.state import STEP_BUCKETS, LiveState

__all__ = ["LiveCollector", "MetricsServer"]


class LiveCollector(Collector):
    def __init__(
        self,
        state: LiveState,
        lock: threading.Lock | threading.RLock,
        goodput: Callable[[], Goodput | None],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._state = state
        self._lock = lock
        self._goodput = goodput
        self._clock = clock
        self.scrapes = 0
        self.cpu_s = 0.0
        """CPU seconds of the scrapes' threads from the first family built to the last one
        written out (the exposition formats each as it is yielded)."""

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: the names are ours alone

    def collect(self) -> Iterator[Metric]:
        t0 = time.thread_time()
        with self._lock:
            out = [*_ranks(self._state), *_run(self._state, self._goodput(), self._clock())]
            out += [*_checkpoints(self._state, self._clock()), *_recoveries(self._state)]
            out += _health(self._state)
        try:
            yield from out
        finally:
            with self._lock:
                self.scrapes += 1
                self.cpu_s += time.thread_time() - t0


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> Any:
    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    if value is not None:
        g.add_metric(list((labels or {}).values()), value)
    return g


def _ranks(s: LiveState) -> list[Metric]:
    step = GaugeMetricFamily(
        "resilient_step",
        "Steps the rank has completed (the step it runs next); after a resume, the step it "
        "resumed at",
        labels=["rank"],
    )
    last = GaugeMetricFamily(
        "resilient_last_step_timestamp_seconds",
        "Unix time the rank's newest completed step ended (train.progress t1)",
        labels=["rank"],
    )
    run = CounterMetricFamily(
        "resilient_steps",
        "Steps the rank has completed, steps run again after a recovery included",
        labels=["rank"],
    )
    score = GaugeMetricFamily(
        "resilient_straggler_score",
        "The median rank's time per step over this rank's (1: the median's pace, 0.5: twice "
        "as slow), from straggler.scores",
        labels=["rank"],
    )
    flagged = CounterMetricFamily(
        "resilient_stragglers_detected",
        "Times the rank was newly flagged a straggler (straggler.detected)",
        labels=["rank"],
    )
    for rank, r in sorted(s.ranks.items()):
        lab = [str(rank)]
        if r.step is not None:
            step.add_metric(lab, r.step)
        if r.last_step_t is not None:
            last.add_metric(lab, r.last_step_t)
        run.add_metric(lab, r.steps_run)
        if r.straggler_score is not None:
            score.add_metric(lab, r.straggler_score)
        flagged.add_metric(lab, r.stragglers_detected)
    return [step, last, run, score, flagged]


def _run(s: LiveState, g: Goodput | None, now: float) -> list[Metric]:
    hist = HistogramMetricFamily(
        "resilient_step_seconds",
        "Step body time, every rank: each train.progress window's steps at its mean, "
        "busy_s / steps",
    )
    cumulative, acc = [], 0
    for bound, n in zip([*map(str, STEP_BUCKETS), "+Inf"], s.step_buckets, strict=True):
        acc += n
        cumulative.append((bound, acc))
    hist.add_metric([], cumulative, s.step_sum)
    out: list[Metric] = [hist]
    out.append(
        _gauge(
            "resilient_steps_per_second",
            "The lead rank's steps per second over its last 30 s of steps",
            s.steps_per_second(),
        )
    )
    out.append(
        _gauge(
            "resilient_total_steps",
            "The planned number of steps, once an event says it",
            s.total_steps,
        )
    )
    out.append(_gauge("resilient_attempt", "The current attempt (restart count)", s.attempt))
    out.append(_gauge("resilient_world_size", "Ranks in the current attempt", s.world_size))
    out.append(
        _gauge(
            "resilient_run_info",
            "Always 1; the run's id as a label",
            1 if s.run_id else None,
            {"run_id": str(s.run_id)},
        )
    )
    out.append(
        _gauge(
            "resilient_goodput",
            "Goodput so far as resilient report computes it: productive step time over wall "
            "time (recomputed at most every 10 s)",
            g.goodput if g else None,
        )
    )
    out.append(
        _gauge(
            "resilient_productive_seconds",
            "Step time that counts towards the final state so far (resilient report)",
            g.productive_s if g else None,
        )
    )
    out.append(
        _gauge(
            "resilient_wall_seconds",
            "The run's wall time so far, first event to newest (resilient report)",
            g.wall_s if g else None,
        )
    )
    return out


def _checkpoints(s: LiveState, now: float) -> list[Metric]:
    out: list[Metric] = []
    for what, n, sec, size, last in (
        ("save", len(s.saves), s.save_seconds_sum, s.save_bytes_sum, s.last_save),
        ("load", len(s.loads), s.load_seconds_sum, s.load_bytes_sum, s.last_load),
    ):
        verb = "commit" if what == "save" else "load"
        out.append(
            SummaryMetricFamily(
                f"resilient_checkpoint_{what}_seconds",
                f"Checkpoint {what}s: seconds to {verb}, the slowest rank's",
                count_value=n,
                sum_value=sec,
            )
        )
        out.append(
            SummaryMetricFamily(
                f"resilient_checkpoint_{what}_bytes",
                f"Checkpoint {what}s: bytes of the checkpoint (its manifest's total)",
                count_value=n,
                sum_value=size,
            )
        )
        out.append(
            _gauge(
                f"resilient_checkpoint_last_{what}_seconds",
                f"Seconds of the newest checkpoint {what}",
                last.seconds if last else None,
            )
        )
        out.append(
            _gauge(
                f"resilient_checkpoint_last_{what}_bytes",
                f"Bytes of the newest checkpoint {what}",
                last.bytes if last else None,
            )
        )
    out.append(
        _gauge(
            "resilient_checkpoint_step",
            "Step of the newest committed checkpoint",
            s.checkpoint_step,
        )
    )
    out.append(
        _gauge(
            "resilient_checkpoint_timestamp_seconds",
            "Unix time the newest checkpoint was committed",
            s.checkpoint_t,
        )
    )
    out.append(
        _gauge(
            "resilient_checkpoint_age_seconds",
            "Seconds since the newest checkpoint was committed",
            None if s.checkpoint_t is None else max(0.0, now - s.checkpoint_t),
        )
    )
    return out


def _recoveries(s: LiveState) -> list[Metric]:
    restarts = CounterMetricFamily(
        "resilient_restarts",
        "Restarts of this node's worker group by its supervisor (attempt.start, restart > 0)",
    )
    restarts.add_metric([], s.restarts)
    kinds = CounterMetricFamily(
        "resilient_recoveries",
        "Recoveries by kind, as resilient report tells them: cold_restart, hot_replacement, "
        "hot_rollback, oom_retry",
        labels=["kind"],
    )
    for kind, n in s.recoveries.items():
        kinds.add_metric([kind], n)
    hangs = CounterMetricFamily("resilient_hangs_detected", "Hangs detected (hang.detected)")
    hangs.add_metric([], s.hangs)
    learned = GaugeMetricFamily(
        "resilient_hang_timeout_learned_seconds",
        "The learned hang timeout of a phase that every rank judges by (hang.timeouts), and "
        "rank 0's learned heartbeat timeout (phase=heartbeat); one left out keeps its fixed one",
        labels=["phase"],
    )
    for phase, seconds in sorted(s.hang_timeouts.items()):
        learned.add_metric([phase], seconds)
    return [restarts, kinds, hangs, learned]


def _health(s: LiveState) -> list[Metric]:
    ok = GaugeMetricFamily(
        "resilient_health_check_ok",
        "1 when the node check passed in its newest round (a skipped check passes), else 0",
        labels=["check"],
    )
    skipped = GaugeMetricFamily(
        "resilient_health_check_skipped",
        "1 when the node check had nothing to check on this node",
        labels=["check"],
    )
    seconds = GaugeMetricFamily(
        "resilient_health_check_seconds", "Seconds the node check took", labels=["check"]
    )
    value = GaugeMetricFamily(
        "resilient_health_check_value",
        "The value the node check measured, for the checks that log a number",
        labels=["check"],
    )
    for name, c in sorted(s.health.items()):
        ok.add_metric([name], 1 if c.ok else 0)
        skipped.add_metric([name], 1 if c.skipped else 0)
        seconds.add_metric([name], c.seconds)
        if c.value is not None:
            value.add_metric([name], c.value)
    rounds = CounterMetricFamily(
        "resilient_health_rounds",
        "Rounds of node checks (health.done), by result: ok or failed",
        labels=["result"],
    )
    for result, n in s.health_rounds.items():
        rounds.add_metric([result], n)
    return [
        ok,
        skipped,
        seconds,
        value,
        rounds,
        _gauge(
            "resilient_health_ok",
            "1 when every check of the newest round passed, else 0",
            None if s.health_ok is None else float(s.health_ok),
        ),
        _gauge(
            "resilient_health_timestamp_seconds",
            "Unix time of the newest round of node checks",
            s.health_t,
        ),
    ]


class MetricsServer:
    """The registry served on `addr:port` (0: any free port) until `close()`."""

    def __init__(self, collector: Collector, *, port: int, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._httpd, self._thread = start_http_server(port, addr, registry=self.registry)
        self.port = int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
