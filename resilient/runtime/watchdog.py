"""The watchdog: heartbeats from a daemon thread, the monitor, verdicts, and the group's exit.

Every rank runs one daemon thread that, each `heartbeat_interval_s`, publishes its heartbeat
to the launcher's store (its own connection, under the attempt's prefix) and looks for a
verdict. Rank 0's thread also judges every rank's heartbeats (HangDetector); the others
judge only rank 0's liveness, so a dead or stopped rank 0 is caught too. Store traffic per
period: one set and one check per rank, one multi_get on rank 0.

A verdict is one JSON object in the store, written by the first rank to claim it (so one
event names the cause). Every rank then exits the same way, whatever its main thread is
doing (blocked in a gloo collective included): the named live ranks dump their Python stacks,
each rank acknowledges, waits briefly for the others' acknowledgements (nobody should die of a
closed connection before it read the verdict), flushes its logs and calls os._exit with the
verdict's code, so torchrun restarts the group. The watchdog never joins a collective itself.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch.distributed as dist
from torch import nn

from resilient.log import get_logger
from resilient.runtime import procinfo
from resilient.runtime.dist import DistContext
from resilient.runtime.exitcodes import ExitCode
from resilient.runtime.forksafe import after_fork_in_child
from resilient.runtime.heartbeat import (
    FLAG_FAILED,
    FLAG_OOM,
    Detection,
    HangDetector,
    Phase,
    Progress,
    WatchdogConfig,
    decode_beats,
    encode_beat,
)
from resilient.runtime.instrument import instrument

__all__ = ["Watchdog", "exit_now"]

_PREFIX = "watchdog"
_BARRIER_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
# Exceptions a store call raises when the store is unreachable or a key never shows.
_STORE_ERRORS = (dist.DistError, RuntimeError, OSError)


class Watchdog:
    """Heartbeats, the hang monitor, the monitored barrier and the group's coordinated exit.

    Created and started by the Runtime. `progress` is the main thread's position; the
    Runtime and the guard move it through phases.
    """

    def __init__(self, config: WatchdogConfig, ctx: DistContext, run_dir: str) -> None:
        self.config = config
        self.ctx = ctx
        self.rank = ctx.rank
        self.run_dir = run_dir
        self.progress = Progress()
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
        self._log = get_logger()

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
        self._store = dist.PrefixStore(_PREFIX, base)
        pid = os.getpid()
        meta = {"host": self.ctx.host, "pid": pid, "start": procinfo.start_time(pid)}
        self._store.set(f"meta/{self.rank}", json.dumps(meta))
        self._publish()
        if self.ctx.distributed:  # nobody reads a heartbeat key before it exists
            dist.barrier(group=self.ctx.control_group)
        watch = list(range(self.ctx.world_size)) if self.rank == 0 else [0]
        self._detector = HangDetector(cfg, watch, liveness_only=self.rank != 0)
        self._watch_keys = [f"hb/{r}" for r in watch]
        if cfg.dump_signal is not None:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            self._signal_file = self.stacks_path.open("a")
            faulthandler.register(
                getattr(signal, cfg.dump_signal), file=self._signal_file, all_threads=True
            )
        self._thread = threading.Thread(target=self._run, name="resilient-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop, barrier=False)
        after_fork_in_child(self)  # a DataLoader worker is not this rank (runtime/forksafe.py)

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
        with contextlib.suppress(*_STORE_ERRORS):
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
        try:
            yield
        finally:
            self.progress.resume(prev)

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
            match = _BARRIER_RANKS.search(str(e))
            ranks = [int(r) for r in match.group(1).replace(" ", "").split(",")] if match else []
            if not ranks:  # rank 0 knows who is missing; its verdict is on the way
                self.wait_for_verdict(3 * self.config.heartbeat_interval_s + 1)
            self.abort(
                kind="barrier",
                code=ExitCode.HANG,
                ranks=ranks,
                reason=f"monitored barrier at step {self.progress.step}: {str(e)[:300]}",
            )
        self.progress.resume(prev)

    def instrument(self, model: nn.Module | None, optimizer: Any) -> list[Any]:
        """Hooks that move the phase without any line in the user's loop; returns handles."""
        return instrument(self.progress, model, optimizer)

    def report_failure(self, *, oom: bool) -> None:
        """Mark this rank failed in its heartbeat, published at once."""
        self.progress.flags |= FLAG_FAILED | (FLAG_OOM if oom else 0)
        if self.active:
            with contextlib.suppress(*_STORE_ERRORS):
                self._publish()

    def verdict_pending(self) -> bool:
        if self._store is None:
            return False
        try:
            return bool(self._store.check(["verdict"]))
        except _STORE_ERRORS:
            return False

    def wait_for_verdict(self, timeout: float) -> None:
        """Wait up to `timeout` s for a verdict and carry it out (then this never returns)."""
        if self._store is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.verdict_pending():
                self._follow()
            time.sleep(min(0.05, self.config.heartbeat_interval_s / 4))

    def abort(
        self,
        *,
        kind: str,
        code: ExitCode,
        ranks: list[int],
        reason: str,
        expect_acks: int | None = None,
        **fields: Any,
    ) -> NoReturn:
        """Take the whole group down: publish a verdict naming `ranks`, then exit with `code`.

        A verdict published first by someone else wins (it is carried out instead).
        """
        if self._store is None:  # no watchdog: peers learn of it from closed connections
            self._log.error("watchdog.exit", code=int(code), kind=kind, ranks=ranks, reason=reason)
            _exit(code)
        if self.verdict_pending():
            self._follow()
        named = self._describe(ranks)
        verdict = {
            "kind": kind,
            "code": int(code),
            "ranks": ranks,
            "named": named,
            "blocked": [],
            "n_blocked": 0,
            "by": self.rank,
            "reason": reason,
            "dump": ranks if kind == "barrier" else [],
            "expect_acks": self.ctx.world_size if expect_acks is None else expect_acks,
            **fields,
        }
        verdict, won = self._claim(verdict)
        self._execute(verdict, won)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_t = time.monotonic()
        while not self._stop.is_set():
            t0 = time.thread_time()
            try:
                self._tick()
                self._store_trouble_since = None
            except _STORE_ERRORS as e:
                if self._stop.is_set():
                    return
                self._store_trouble(e)
            self.cpu_s += time.thread_time() - t0
            self.ticks += 1
            next_t += interval
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a long GIL hold): do not burst to catch up
                next_t, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def _tick(self) -> None:
        self._publish()
        if self._store.check(["verdict"]):
            self._follow()
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
            self._execute(verdict, won)

    def _publish(self) -> None:
        with self._publish_lock:
            self._beat += 1
            self._store.set(f"hb/{self.rank}", encode_beat(self._beat, self.progress))

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
            _exit(ExitCode.PEER_LOST)

    # ------------------------------------------------------------------ verdicts
    def _verdict(self, det: Detection) -> dict[str, Any]:
        metas = self._metas(list(det.ranks[:64]))
        named: list[dict[str, Any]] = []
        for st in det.details:
            meta = metas.get(st.rank, {})
            named.append({**st.as_dict(), "host": meta.get("host"), "pid": meta.get("pid")})
        dump: list[int] = []
        if det.kind == "no_heartbeat":
            for d in named:
                meta = metas.get(d["rank"], {})
                d["state"] = procinfo.process_state(meta, self.ctx.host)
                d["stacks"] = self._dump_other(d["rank"], d["state"], meta)
            stopped = all(d["state"] == "stopped" for d in named)
            code = ExitCode.HANG if stopped else ExitCode.PEER_LOST
            reason = f"no heartbeat for {max(s.silent_s for s in det.details):.1f} s"
        elif det.kind == "failed":
            code = ExitCode.OOM if any(s.oom for s in det.details) else ExitCode.RANK_EXCEPTION
            reason = "a failed rank waits at the guard's agreement while its peers are stuck"
        else:
            code = ExitCode.HANG
            dump = list(det.ranks)
            for d in named:
                d["stacks"] = str(Path(self.run_dir) / "stacks" / f"rank{d['rank']}.txt")
            reason = "no progress past the phase timeout"
        return {
            "kind": det.kind,
            "code": int(code),
            "ranks": list(det.ranks),
            "named": named,
            "blocked": list(det.blocked[:64]),
            "n_blocked": len(det.blocked),
            "by": self.rank,
            "reason": reason,
            "dump": dump if self.config.dump_stacks else [],
            "expect_acks": self.ctx.world_size
            - (len(det.ranks) if det.kind == "no_heartbeat" else 0),
        }

    def _claim(self, verdict: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Publish `verdict` unless another rank's came first; returns (the verdict, won)."""
        try:
            if self._store.add("claim", 1) == 1:
                self._store.set("verdict", json.dumps(verdict))
                return verdict, True
            deadline = time.monotonic() + self.config.heartbeat_timeout_s
            while time.monotonic() < deadline:  # the winner writes it right after claiming
                if self._store.check(["verdict"]):
                    return json.loads(self._store.get("verdict")), False
                time.sleep(0.01)
        except _STORE_ERRORS as e:
            self._log.warning("watchdog.store_error", error=str(e)[:300])
        return verdict, False

    def _follow(self) -> NoReturn:
        try:
            verdict = json.loads(self._store.get("verdict"))
        except _STORE_ERRORS as e:
            verdict = {"kind": "store_lost", "code": int(ExitCode.PEER_LOST), "ranks": []}
            self._log.warning("watchdog.store_error", error=str(e)[:300])
        self._execute(verdict, won=False)

    def _execute(self, v: dict[str, Any], won: bool) -> NoReturn:
        if not self._exit_lock.acquire(blocking=False):
            while True:  # the other thread is carrying out a verdict and will exit the process
                time.sleep(3600)
        code = ExitCode(int(v["code"]))
        if won:
            event = "hang.detected" if code == ExitCode.HANG else "fault.detected"
            fields = {k: v[k] for k in v if k not in ("code", "dump", "expect_acks", "by")}
            self._log.error(event, **fields, exit_code=int(code))
            self._kill_stopped(v)
        try:
            if self.rank in v.get("dump", ()):
                self.dump_stacks(str(v.get("reason", "")))
            self._store.add("ack", 1)
        except _STORE_ERRORS as e:
            self._log.warning("watchdog.store_error", error=str(e)[:300])
        self._log.error(
            "watchdog.exit",
            code=int(code),
            kind=v.get("kind"),
            ranks=v.get("ranks"),
            decided_by=v.get("by"),
        )
        deadline = time.monotonic() + float(self.config.exit_grace_s or 0)
        expected = int(v.get("expect_acks", self.ctx.world_size))
        with contextlib.suppress(*_STORE_ERRORS):
            while time.monotonic() < deadline and self._store.add("ack", 0) < expected:
                time.sleep(min(0.05, self.config.heartbeat_interval_s / 4))
        _exit(code)

    def dump_stacks(self, why: str) -> Path:
        """Append every thread's Python stack to <run_dir>/stacks/rank<R>.txt, with this
        process's children (and their stacks, where py-spy is installed)."""
        self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
        with self.stacks_path.open("a") as f:
            now = datetime.now(timezone.utc).isoformat()
            f.write(
                f"\n# rank {self.rank} restart {self.ctx.restart} pid {os.getpid()} "
                f"step {self.progress.step} phase {self.progress.phase.name.lower()} "
                f"at {now}: {why}\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            # a stall may sit in a child (a DataLoader worker the main thread waits on)
            kids = procinfo.children(os.getpid())
            for kid in kids:
                f.write(f"# child pid {kid['pid']} {kid['name']} ({kid['status']})\n")
        for kid in kids[:8]:
            header = f"rank {self.rank}'s child pid {kid['pid']} {kid['name']}"
            procinfo.dump_with_pyspy(int(kid["pid"]), self.stacks_path, header)
        self._log.error("stacks.dumped", path=str(self.stacks_path), children=kids[:8])
        return self.stacks_path

    # ------------------------------------------------------------------ peers
    def _metas(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        if not ranks:
            return {}
        try:
            raw = self._store.multi_get([f"meta/{r}" for r in ranks])
        except _STORE_ERRORS:
            return {}
        return {r: json.loads(m) for r, m in zip(ranks, raw, strict=True)}

    def _describe(self, ranks: list[int]) -> list[dict[str, Any]]:
        """Last heartbeat and identity of `ranks` (for verdicts raised from the main thread)."""
        if not ranks:
            return []
        metas = self._metas(ranks)
        try:
            beats = decode_beats(self._store.multi_get([f"hb/{r}" for r in ranks]))
        except _STORE_ERRORS:
            return [{"rank": r} for r in ranks]
        return [
            {
                "rank": r,
                "step": int(b["step"]),
                "phase": Phase(min(int(b["phase"]), int(Phase.CLOSED))).name.lower(),
                "host": metas.get(r, {}).get("host"),
                "pid": metas.get(r, {}).get("pid"),
            }
            for r, b in zip(ranks, beats, strict=True)
        ]

    def _dump_other(self, rank: int, state: str, meta: dict[str, Any]) -> str:
        """A rank without heartbeat cannot dump its own stacks; py-spy can, where installed."""
        if state == "dead":
            return "none: the process is gone"
        if not state.startswith(("stopped", "running")):
            return f"none: the rank is on another host ({meta.get('host')}); no heartbeat"
        why = "stopped (SIGSTOP), it cannot run its own dump" if state == "stopped" else "silent"
        path = Path(self.run_dir) / "stacks" / f"rank{rank}.txt"
        header = f"rank {rank} pid {meta['pid']} (by rank {self.rank})"
        got = procinfo.dump_with_pyspy(int(meta["pid"]), path, header)
        if got == procinfo.NO_PYSPY:
            return f"none: process {why}; py-spy is not installed"
        return got

    def _kill_stopped(self, v: dict[str, Any]) -> None:
        if not self.config.kill_stopped:
            return
        for d in v.get("named", []):
            if d.get("state") == "stopped" and d.get("pid"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(d["pid"]), signal.SIGKILL)
                    self._log.warning("watchdog.killed", rank=d["rank"], pid=d["pid"])


def exit_now(code: int, **fields: Any) -> NoReturn:
    """Log `watchdog.exit` with `fields`, flush, and leave with `code` (no verdict needed:
    used where every rank reached the same decision together)."""
    get_logger().error("watchdog.exit", code=int(code), **fields)
    _exit(code)


def _exit(code: int) -> NoReturn:
    """Leave now: no atexit, no joins (a thread may be stuck in a collective forever)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to save
            stream.flush()
    os._exit(int(code))
