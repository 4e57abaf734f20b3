"""The verdict protocol: how one rank's finding becomes the whole group's exit.

A verdict is one JSON object in the store, written by the first rank to claim it (so one
event names the cause). Every rank then exits the same way, whatever its main thread is
doing (blocked in a gloo collective included): the named live ranks dump their Python stacks,
each rank acknowledges, waits briefly for the others' acknowledgements (nobody should die of a
closed connection before it read the verdict), flushes its logs and calls os._exit with the
verdict's code, so torchrun restarts the group. `Verdicts` is mixed into the Watchdog (which
owns the store connection and the thread that carries verdicts out); it never joins a
collective.

Under hot recovery (`resilient run --hot-recovery`, hot/recovery.py) a verdict that names one
stalled or silent rank is a hot verdict: only the named rank leaves (its own thread exits it;
a stopped or silent one on this host is SIGKILLed by the rank that won the claim), and the
others stay. Their main threads, blocked in a collective with it, then meet the closed
connection and take the hot path like any lost peer; a rank whose main thread has not done
so within `HotMode.wait_s` exits with the verdict's code after all (cold).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from resilient import events as ev
from resilient import storekeys
from resilient.envvars import HotMode
from resilient.exitcodes import ExitCode
from resilient.groups.exits import hard_exit
from resilient.groups.groups import DistContext
from resilient.hang import procinfo
from resilient.hang.config import WatchdogConfig
from resilient.hang.departed import Departures
from resilient.hang.heartbeat import Detection, decode_beats
from resilient.hang.phases import Phase, Progress

__all__ = ["STORE_ERRORS", "Verdicts", "hot_eligible", "judge", "spares"]

# Exceptions a store call raises when the store is unreachable or a key never shows.
STORE_ERRORS = (dist.DistError, RuntimeError, OSError)


# ---------------------------------------------------------------- the rules, pure
def judge(det: Detection, states: list[str]) -> tuple[ExitCode, str]:
    """The exit code and reason of a verdict on `det`; `states`: the named ranks' process
    states (procinfo.process_state), known for silent ranks only."""
    if det.kind == "no_heartbeat":
        stopped = all(s == "stopped" for s in states)
        silent = max(s.silent_s for s in det.details)
        return (
            ExitCode.HANG if stopped else ExitCode.PEER_LOST
        ), f"no heartbeat for {silent:.1f} s"
    if det.kind == "failed":
        code = ExitCode.OOM if any(s.oom for s in det.details) else ExitCode.RANK_EXCEPTION
        return code, "a failed rank waits at the guard's agreement while its peers are stuck"
    return ExitCode.HANG, "no progress past the phase timeout"


def hot_eligible(det: Detection, *, hot: bool) -> bool:
    """Under hot recovery (`hot`: on, and several processes), one stalled or silent rank
    alone leaves and is replaced; the others stay."""
    return hot and len(det.ranks) == 1 and det.kind in ("stalled", "no_heartbeat")


def spares(verdict: dict[str, Any], rank: int) -> bool:
    """A hot verdict that does not name `rank`: that rank stays (carry_out)."""
    return bool(verdict.get("hot")) and rank not in verdict.get("ranks", ())


class Verdicts:
    """Publishing, claiming and carrying out verdicts; a mixin of the Watchdog, which sets
    these attributes."""

    config: WatchdogConfig
    ctx: DistContext
    rank: int
    run_dir: str
    progress: Progress
    hot: HotMode
    stacks_path: Path
    _store: Any
    _stop: threading.Event
    _exit_lock: threading.Lock
    _log: Any
    _departures: Departures

    def verdict_pending(self) -> bool:
        if self._store is None:
            return False
        try:
            return bool(self._store.check([storekeys.VERDICT]))
        except STORE_ERRORS:
            return False

    def wait_for_verdict(self, timeout: float) -> None:
        """Wait up to `timeout` s for a verdict and carry it out (then this never returns).
        A hot verdict that spares this rank returns at once: the watchdog's thread carries it
        out, and the caller (the guard, with a lost peer) takes the hot path."""
        if self._store is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.verdict_pending():
                verdict, _ = self._read_verdict()
                if self._spares(verdict):
                    return
                self._execute(verdict, won=False)
            time.sleep(min(0.05, self.config.heartbeat_interval_s / 4))

    def abort(
        self,
        *,
        kind: str,
        code: ExitCode,
        ranks: list[int],
        reason: str,
        expect_acks: int | None = None,
        detail: dict[str, Any] | None = None,
        **fields: Any,
    ) -> NoReturn:
        """Take the whole group down: publish a verdict naming `ranks`, then exit with `code`.
        `detail` goes into each named rank's entry (a stall's timeout, for instance).

        A verdict published first by someone else wins (it is carried out instead).
        """
        if self._store is None:  # no watchdog: peers learn of it from closed connections
            self._log.error("watchdog.exit", code=int(code), kind=kind, ranks=ranks, reason=reason)
            hard_exit(code)
        if self.verdict_pending():
            self._follow()
        named = [{**d, **(detail or {})} for d in self._describe(ranks)]
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
        elif det.kind != "failed":
            dump = list(det.ranks)
            for d in named:
                d["stacks"] = str(Path(self.run_dir) / "stacks" / f"rank{d['rank']}.txt")
        code, reason = judge(det, [d.get("state", "") for d in named])
        return {
            "kind": det.kind,
            "code": int(code),
            "ranks": list(det.ranks),
            "hot": hot_eligible(det, hot=self.hot.enabled and self.ctx.distributed),
            "named": named,
            "blocked": list(det.blocked[:64]),
            "n_blocked": len(det.blocked),
            "by": self.rank,
            "reason": reason,
            "dump": dump if self.config.dump_stacks else [],
            "expect_acks": self.ctx.world_size
            - (len(det.ranks) if det.kind == "no_heartbeat" else 0),
        }

    def carry_out(self, v: dict[str, Any], won: bool) -> None:
        """From the watchdog's thread: carry out verdict `v`. Returns only on a rank that
        stays for a hot verdict, once its main thread went hot (the Runtime stopped this
        thread); never returns otherwise."""
        if not self._spares(v):
            self._execute(v, won)
        code = self._take_part(v, won)
        self._log.warning(ev.RECOVERY_HOT_AWAIT, ranks=v.get("ranks"), decided_by=v.get("by"))
        if self._await_main(self.hot.wait_s):  # the main thread met the loss and went hot
            return
        why = f"the main thread did not meet rank {v.get('ranks')}'s loss in {self.hot.wait_s:g} s"
        self._log.error(ev.RECOVERY_COLD, reason=why)
        with contextlib.suppress(OSError):  # where it waited instead
            self.dump_stacks(why)
        hard_exit(code)

    def _await_main(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the main thread to go hot (it stops this thread). The
        main thread may wait on a survivor that already left rather than on the lost rank
        (a mesh's sub-group): cut those connections meanwhile (hang/departed.py)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._stop.wait(self.config.heartbeat_interval_s):
                return True
            with contextlib.suppress(*STORE_ERRORS):
                self._departures.poll(self._store, self.progress)
        return self._stop.is_set()

    def _spares(self, v: dict[str, Any]) -> bool:
        return spares(v, self.rank)

    def _claim(self, verdict: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Publish `verdict` unless another rank's came first; returns (the verdict, won)."""
        try:
            if self._store.add(storekeys.CLAIM, 1) == 1:
                self._store.set(storekeys.VERDICT, json.dumps(verdict))
                return verdict, True
            deadline = time.monotonic() + self.config.heartbeat_timeout_s
            while time.monotonic() < deadline:  # the winner writes it right after claiming
                if self._store.check([storekeys.VERDICT]):
                    return json.loads(self._store.get(storekeys.VERDICT)), False
                time.sleep(0.01)
        except STORE_ERRORS as e:
            self._log.warning("watchdog.store_error", error=str(e)[:300])
        return verdict, False

    def _follow(self) -> NoReturn:
        self._execute(*self._read_verdict())

    def _read_verdict(self) -> tuple[dict[str, Any], bool]:
        """The published verdict (someone else's: not won here)."""
        try:
            verdict = json.loads(self._store.get(storekeys.VERDICT))
        except STORE_ERRORS as e:
            verdict = {"kind": "store_lost", "code": int(ExitCode.PEER_LOST), "ranks": []}
            self._log.warning("watchdog.store_error", error=str(e)[:300])
        return verdict, False

    def _execute(self, v: dict[str, Any], won: bool) -> NoReturn:
        code = self._take_part(v, won)
        self._log.error(
            "watchdog.exit",
            code=int(code),
            kind=v.get("kind"),
            ranks=v.get("ranks"),
            decided_by=v.get("by"),
        )
        deadline = time.monotonic() + float(self.config.exit_grace_s or 0)
        expected = int(v.get("expect_acks", self.ctx.world_size))
        with contextlib.suppress(*STORE_ERRORS):
            while time.monotonic() < deadline and self._store.add("ack", 0) < expected:
                time.sleep(min(0.05, self.config.heartbeat_interval_s / 4))
        hard_exit(code)

    def _take_part(self, v: dict[str, Any], won: bool) -> ExitCode:
        """This rank's part in verdict `v`, short of leaving: the one thread to carry it out,
        the announcement and the kills (by the winner), this rank's stack dump when named
        for one, its acknowledgement. Returns the verdict's exit code."""
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
        except STORE_ERRORS as e:
            self._log.warning("watchdog.store_error", error=str(e)[:300])
        return code

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
            raw = self._store.multi_get([storekeys.meta(r) for r in ranks])
        except STORE_ERRORS:
            return {}
        return {r: json.loads(m) for r, m in zip(ranks, raw, strict=True)}

    def _describe(self, ranks: list[int]) -> list[dict[str, Any]]:
        """Last heartbeat and identity of `ranks` (for verdicts raised from the main thread)."""
        if not ranks:
            return []
        metas = self._metas(ranks)
        try:
            beats = decode_beats(self._store.multi_get([storekeys.heartbeat(r) for r in ranks]))
        except STORE_ERRORS:
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
        """SIGKILL the named ranks on this host that cannot exit themselves: stopped ones
        and, in a hot verdict, silent running ones (their replacement is on its way)."""
        if not self.config.kill_stopped:
            return
        states = ("stopped", "running") if v.get("hot") else ("stopped",)
        for d in v.get("named", []):
            if d.get("state") in states and d.get("pid"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(d["pid"]), signal.SIGKILL)
                    self._log.warning("watchdog.killed", rank=d["rank"], pid=d["pid"])
