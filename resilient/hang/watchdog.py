"""The watchdog: heartbeats from a daemon thread, the monitor, and the monitored barrier.

Every rank runs one daemon thread that, each `heartbeat_interval_s`, publishes its heartbeat
to the launcher's store (its own connection, under the attempt's prefix) and looks for a
verdict. Rank 0's thread also judges every rank's heartbeats (HangDetector); the others
judge only rank 0's liveness, so a dead or stopped rank 0 is caught too. Store traffic per
period: one set and one check per rank, one multi_get on rank 0. What a finding becomes (a
verdict every rank carries out, os._exit with its code) is the protocol in verdict.py.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist
from torch import nn

from resilient import events as ev
from resilient import storekeys
from resilient.envvars import HotMode
from resilient.exitcodes import ExitCode
from resilient.groups._torch_compat import barrier_missing_ranks
from resilient.groups.exits import hard_exit
from resilient.groups.forksafe import after_fork_in_child
from resilient.groups.groups import DistContext
from resilient.hang import procinfo
from resilient.hang.config import WatchdogConfig
from resilient.hang.departed import Departures, announce, generation_over
from resilient.hang.heartbeat import HangDetector, encode_beat, straggler_scores
from resilient.hang.instrument import instrument
from resilient.hang.learned import LearnedTimeouts, PhaseStats
from resilient.hang.phases import FLAG_FAILED, FLAG_OOM, Phase, Progress
from resilient.hang.probes import Probes
from resilient.hang.verdict import STORE_ERRORS, Verdicts
from resilient.log import get_logger

__all__ = ["CLOSE_LOOK_S", "Watchdog"]

CLOSE_LOOK_S = 0.05
"""How often the monitor looks at the beats while a timeout falls due (at most a quarter of
the heartbeat interval): the most a stall is named after its timeout, plus a store read."""


class Watchdog(Verdicts):
    """Heartbeats, the hang monitor, the monitored barrier and the group's coordinated exit.

    Created and started by the Runtime. `progress` is the main thread's position; the
    Runtime and the guard move it through phases.
    """

    def __init__(
        self, config: WatchdogConfig, ctx: DistContext, run_dir: str, hot: HotMode | None = None
    ) -> None:
        self.config = config
        self.hot = hot or HotMode()
        """Hot recovery as the Runtime decided it: whether a verdict may spare the others."""
        self.ctx = ctx
        self.rank = ctx.rank
        self.run_dir = run_dir
        self.progress = Progress()
        self.learned = LearnedTimeouts(config, ctx.world_size)
        """The learned timeouts: a stateful extra of the common state (hang/learned.py)."""
        if config.learn_timeouts:
            self.progress.stats = PhaseStats()
        self.stacks_path = Path(run_dir) / "stacks" / f"rank{ctx.rank}.txt"
        self.cpu_s = 0.0
        """CPU time the heartbeat thread used so far (for the overhead benchmark)."""
        self.ticks = 0
        self._store: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._publish_lock = threading.Lock()
        self._exit_lock = threading.Lock()
        self._beat = 0
        self._detector: HangDetector | None = None
        self._watch_keys: list[str] = []
        self._signal_file: TextIO | None = None
        self._store_trouble_since: float | None = None
        self._scores = _StragglerScores(config, ctx)
        self._agree_every = max(1, round(2.0 / config.heartbeat_interval_s))
        self._log = get_logger()
        self._departures = Departures(ctx.rank, stuck_s=config.heartbeat_interval_s)
        self.probes = Probes()  # stalls this rank names itself, looked at each tick

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Publish this rank's first heartbeat, wait until every rank has, start the thread.

        A collective on the control group: every rank calls it, at the same point.
        """
        cfg = self.config
        if not cfg.enabled:
            return
        base = self.ctx.store.clone() if self.ctx.store is not None else dist.HashStore()
        base.set_timeout(timedelta(seconds=cfg.heartbeat_timeout_s))
        self._store = dist.PrefixStore(storekeys.WATCHDOG, base)
        launcher = getattr(base, "underlying_store", None)  # under the generation's prefix
        if self.hot.enabled and launcher is not None:
            self._departures.lost = generation_over(launcher, self.hot)
        pid = os.getpid()
        meta = {"host": self.ctx.host, "pid": pid, "start": procinfo.start_time(pid)}
        self._store.set(storekeys.meta(self.rank), json.dumps(meta))
        self._store.set(storekeys.learned(self.rank), self.learned.restored.tobytes())
        self._publish()
        if self.ctx.distributed:  # nobody reads a heartbeat key before it exists
            dist.barrier(group=self.ctx.control_group)
        watch = list(range(self.ctx.world_size)) if self.rank == 0 else [0]
        self._detector = HangDetector(cfg, watch, liveness_only=self.rank != 0)
        self._watch_keys = [storekeys.heartbeat(r) for r in watch]
        if cfg.dump_signal is not None:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            self._signal_file = self.stacks_path.open("a")
            faulthandler.register(
                getattr(signal, cfg.dump_signal), file=self._signal_file, all_threads=True
            )
        self._thread = threading.Thread(target=self._run, name="resilient-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop, barrier=False)
        after_fork_in_child(self)  # a DataLoader worker is not this rank (groups/forksafe.py)

    def stop(self, *, barrier: bool = False) -> None:
        """Say "closed" (peers stop expecting heartbeats) and stop the thread. Idempotent.

        `barrier`: first wait on the control group until every rank got here, still
        monitoring, so a rank that hangs on its way out is caught rather than waited for.
        """
        if self._thread is None:
            return
        if barrier and self.ctx.distributed and not self._stop.is_set():
            self.progress.enter(Phase.FINISH)
            dist.barrier(group=self.ctx.control_group)
        self.progress.enter(Phase.CLOSED)
        self._stop.set()
        self._thread.join(timeout=self.config.heartbeat_timeout_s)
        self._thread = None
        with contextlib.suppress(*STORE_ERRORS):
            self._publish()
        if self._signal_file is not None and self.config.dump_signal is not None:
            faulthandler.unregister(getattr(signal, self.config.dump_signal))
            self._signal_file.close()
            self._signal_file = None
        atexit.unregister(self.stop)
        self._log.debug("watchdog.stopped", ticks=self.ticks, cpu_s=round(self.cpu_s, 4))

    def _after_fork_child(self) -> None:
        """In a forked child: no thread, no store, fresh locks (the parent's may be held by
        its heartbeat thread, which the child does not have)."""
        self._thread = None
        self._store = None
        self._stop = threading.Event()
        self._stop.set()
        self._publish_lock = threading.Lock()
        self._exit_lock = threading.Lock()
        self._signal_file = None

    # ------------------------------------------------------------------ main-thread API
    @contextlib.contextmanager
    def phase(self, name: str | Phase) -> Iterator[None]:
        """Run the block in phase `name` (its own timeout), then return to the previous one."""
        phase = Phase.parse(name)
        prev = self.progress.phase
        self.progress.enter(phase)
        held = self.progress.hold(phase)  # its forwards keep the fixed timeouts
        try:
            yield
        finally:
            self.progress.resume(prev)
            self.progress.release(held)

    def step_begin(self, step: int) -> None:
        self.progress.begin_step(step)

    def step_end(self, steps_done: int) -> None:
        """After a step's body: the first one tightens the timeouts; every N a barrier."""
        self.progress.end_step()
        every = self.config.barrier_every_steps
        if every is not None and steps_done % every == 0 and self.active:
            self.barrier()

    def barrier(self) -> None:
        """A monitored barrier on the control group; a rank that never arrives is named (by
        rank 0, which then takes the group down with a verdict)."""
        if not self.ctx.distributed:
            return
        prev = self.progress.phase
        self.progress.enter(Phase.AGREE)
        timeout = timedelta(seconds=float(self.config.barrier_timeout_s or 0))
        try:
            dist.monitored_barrier(
                group=self.ctx.control_group, timeout=timeout, wait_all_ranks=True
            )
        except RuntimeError as e:
            ranks = barrier_missing_ranks(str(e)) or []
            if not ranks:  # rank 0 knows who is missing; its verdict is on the way
                self.wait_for_verdict(3 * self.config.heartbeat_interval_s + 1)
            self.abort(
                kind="barrier",
                code=ExitCode.HANG,
                ranks=ranks,
                reason=f"monitored barrier at step {self.progress.step}: {str(e)[:300]}",
            )
        self.progress.resume(prev)

    def instrument(
        self, model: nn.Module | None, optimizer: Any, stage: int | None = None
    ) -> list[Any]:
        """Hooks that move the phase without any line in the user's loop; returns handles.
        A pipeline `stage` reports its micro-batch too (hang/instrument.py)."""
        return instrument(self.progress, model, optimizer, stage)

    def announce_departure(self) -> None:
        """This survivor leaves the generation for the next one (hot recovery): say so, so
        that a rank still waiting on it in a collective cuts their connections."""
        if self._store is not None:
            with contextlib.suppress(*STORE_ERRORS):
                announce(self._store, self.rank, self.progress.step)

    def cut_departed(self) -> None:
        """On a survivor leaving its generation, while it drains its in-flight save: cut its
        connections to the survivors that left too. Their save threads may wait on this one's
        in a checkpoint-group collective that the lost rank never joins, and this one's on
        theirs; with every leaver's watchdog stopped nothing else would cut them loose."""
        if self._store is not None and self.hot.enabled:
            with contextlib.suppress(*STORE_ERRORS):
                self._departures.cut(self._store, self.progress)

    def report_failure(self, *, oom: bool) -> None:
        """Mark this rank failed in its heartbeat, published at once."""
        self.progress.flags |= FLAG_FAILED | (FLAG_OOM if oom else 0)
        if self.active:
            with contextlib.suppress(*STORE_ERRORS):
                self._publish()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        """A tick (beat, verdict check, a look at the watched beats) every interval, and
        close looks in between while a timeout falls due before the next tick or the one
        after (a watched age is known only as of its last beat seen, up to an interval old;
        looking every CLOSE_LOOK_S sees each beat within that long of its writing)."""
        interval = self.config.heartbeat_interval_s
        close = min(CLOSE_LOOK_S, interval / 4)
        next_t = time.monotonic()
        due = math.inf
        while not self._stop.is_set():
            t0 = time.thread_time()
            try:
                due = self._tick()
                self._store_trouble_since = None
            except STORE_ERRORS as e:
                if self._stop.is_set():
                    return
                self._store_trouble(e)
            self.ticks += 1
            next_t += interval
            if next_t < time.monotonic():  # fell behind (a long GIL hold): no burst
                next_t = time.monotonic()
            while due <= 2 * interval and time.monotonic() + close < next_t:
                self.cpu_s += time.thread_time() - t0
                if self._stop.wait(close):
                    return
                t0 = time.thread_time()
                try:
                    due = self._look()
                except STORE_ERRORS:
                    break  # the next tick meets it and counts the trouble
            self.cpu_s += time.thread_time() - t0
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def _tick(self) -> float:
        """One period's work; returns when the next timeout falls due (HangDetector)."""
        self._publish()
        if self._store.check([storekeys.VERDICT]):
            self.carry_out(*self._read_verdict())
            return math.inf
        if self.hot.enabled:  # survivors that left while this main thread waits on them
            self._departures.poll(self._store, self.progress)
        stall = self.probes.run(self._log)  # hang/probes.py
        if stall is not None and not self._stop.is_set():
            self.abort(**stall.verdict(self.rank, dump=self.config.dump_stacks))
        due = self._look()
        if self._stop.is_set():  # a hot verdict carried out: the Runtime stopped this thread
            return math.inf
        if self.config.learn_timeouts and self.ticks % self._agree_every == 0:
            self._agree_learned()
        self._scores.log(self._store, self._log)
        return due

    def _look(self) -> float:
        """Read the watched ranks' beats and judge them: a verdict, or when to look again."""
        assert self._detector is not None
        report = self._detector.update(self._store.multi_get(self._watch_keys))
        for s in report.stragglers:
            self._log.warning(
                "straggler.cleared" if s.cleared else "straggler.detected",
                straggler=s.rank,
                step=s.step,
                local_s=round(s.local_s, 4),
                median_s=round(s.median_s, 4),
                factor=self.config.straggler_factor,
            )
        if report.detection is not None and not self._stop.is_set():
            verdict, won = self._claim(self._verdict(report.detection))
            self.carry_out(verdict, won)
            return math.inf
        return report.due_s

    def _agree_learned(self) -> None:
        """Rank 0 judges by the learned timeouts every rank agreed (hang/learned.py)."""
        p, det = self.progress, self._detector
        agreed = self.learned.exchange(self._store, self.rank, p, self.ctx.world_size)
        if agreed is not None and det is not None:
            det.set_learned(agreed)
            if self.learned.adopt(agreed) | self.learned.adopt_heartbeat(det.heartbeat_learned_s):
                pinned = sorted(ph.name.lower() for ph in self.config.pinned())
                fields = self.learned.fields()
                self._log.info(ev.HANG_TIMEOUTS, step=p.step, pinned=pinned, **fields)

    def _publish(self) -> None:
        with self._publish_lock:
            self._beat += 1
            self._store.set(storekeys.heartbeat(self.rank), encode_beat(self._beat, self.progress))

    def _store_trouble(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._store_trouble_since is None:
            self._store_trouble_since = now
            self._log.warning("watchdog.store_error", error=str(exc)[:300])
            return
        if now - self._store_trouble_since > self.config.heartbeat_timeout_s:
            # the launcher's store is gone (its agent died): nobody can coordinate any more
            self._log.error(
                "fault.detected",
                kind="store_lost",
                error=str(exc)[:300],
                exit_code=int(ExitCode.PEER_LOST),
            )
            self._log.error("watchdog.exit", code=int(ExitCode.PEER_LOST), kind="store_lost")
            hard_exit(ExitCode.PEER_LOST)


class _StragglerScores:
    """Local rank 0 logs every rank's straggler score every straggler_scores_every_s: one
    read of all heartbeats, off the training thread (the live metrics read the event)."""

    def __init__(self, config: WatchdogConfig, ctx: DistContext) -> None:
        self.every = config.straggler_scores_every_s
        self.ctx = ctx
        self.due = time.monotonic()

    def log(self, store: Any, log: Any) -> None:
        ctx = self.ctx
        if self.every is None or ctx.local_rank != 0 or ctx.world_size < 2:
            return
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + self.every
        ranks = range(ctx.world_size)
        scores = straggler_scores(store.multi_get([storekeys.heartbeat(r) for r in ranks]), ranks)
        if scores:
            first = ctx.rank - ctx.local_rank
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            log.info(
                "straggler.scores",
                scores={str(r): round(v, 3) for r, v in scores.items()},
                node_ranks=list(range(first, first + local_world)),
            )
