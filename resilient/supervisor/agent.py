"""torch elastic's LocalElasticAgent with resilient's stop and restart rules.

The agent's own loop (rendezvous, start, monitor, restart on failure or on a membership
change) is unchanged; this subclass overrides its extension points (starting, monitoring,
stopping the workers, shutting down) and reads its state (the workers' pids, the restarts
left) through ElasticAgentBase in supervisor/_torch_compat.py, which holds the private names.

What changes:
- A failed rank's peers are SIGKILLed at once. torch would send SIGTERM and wait 30 s, but
  SIGTERM now means "save and leave" to a resilient worker, which a broken group cannot do.
- Ranks that leave with ExitCode.PREEMPTED are given the grace period to finish committing.
- A healthy group stopped for a membership change (a node joins) gets SIGTERM and the grace
  period: it saves, so the new world resumes with zero steps lost.
- After a failure the supervisor's hooks decide: restart after a backoff, or stop (crash loop,
  preempted). A stop sets the remaining restarts to zero, so the agent returns the result.
- Hot recovery (`hot_max` > 0, `resilient run --hot-recovery`): when exactly one local
  worker dies and the group is not already recovering, the others are left running; one new
  process takes the dead one's local rank (`replace_worker`) with the next generation, which
  is published on the workers' store for the survivors, who re-run their script in place
  (resilient/runtime/hot.py). Anything else, or a failure while a generation is still
  forming, takes the restart path below, with a `recovery.cold` event saying why.
  On several nodes the generations are the store's, not one agent's: each agent claims the
  next one there (compare-and-set), and a node's agent SIGKILLs its own worker when a hot
  verdict names it and it cannot leave by itself (stopped, or silent), since the rank that
  found it may sit on another node and cannot reach the process (`_kill_named`).
- Every agent of a rendezvous round agrees on one attempt id, exported as RESILIENT_ATTEMPT:
  the workers' per-attempt store prefix. TORCHELASTIC_RESTART_COUNT differs between nodes
  after one rejoins, and a prefix built from it would split the group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import psutil
from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousError

from resilient import events as ev
from resilient.envvars import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    ENV_ATTEMPT,
    ENV_GENERATION,
    ENV_STORE,
    WATCHDOG_PREFIX,
    hosted_store,
    hot_store_prefix,
    watchdog_setting,
    worker_store_prefix,
)
from resilient.exitcodes import ExitCode
from resilient.supervisor._torch_compat import ElasticAgentBase
from resilient.supervisor.spare import Spare

__all__ = ["AgentHooks", "FailureInfo", "SupervisedAgent", "Verdict"]

_ROUND_KEY = "resilient/round"
_SPARE_DEFER_MAX_S = 30.0
"""How long after a hot replacement the next spare may wait for the new generation's first
step (then it starts anyway): see SupervisedAgent._start_spare_when_stepped."""
_VERDICT_POLL_S = 0.25
"""How often an agent under hot recovery looks for a hot verdict naming one of its workers."""
_STORE_TIMEOUT_S = 2.0
"""The agent's calls to the workers' store: milliseconds when it is up; torch's client retries
a refused connection until this timeout, so a store whose host died costs it once."""
_NAMED_EXIT_GRACE_S = 10.0
"""How long a worker named by a hot verdict for a stall (its watchdog thread still runs: it
dumps its stacks and exits by itself) may take before its agent SIGKILLs it."""


@dataclass(frozen=True, slots=True)
class FailureInfo:
    """One rank's exit as the agent saw it."""

    rank: int
    local_rank: int
    pid: int
    exit_code: int
    error_file_message: str | None
    root: bool
    """It exited on its own, before the agent stopped the others."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do after a failed group: "restart" (after delay_s), "stop" (with code), or
    "rejoin" (a membership change: restart without counting it as a failure)."""

    action: str
    delay_s: float = 0.0
    code: int | None = None


class AgentHooks(Protocol):
    def on_start(
        self, *, restart: int, attempt_id: str, world_size: int, group_rank: int, pids: list[int]
    ) -> None: ...

    def on_failure(
        self, *, restart: int, failures: list[FailureInfo], restarts_left: int, nodes_waiting: int
    ) -> Verdict: ...

    def on_event(self, event: str, **fields: Any) -> None: ...


def peek_exit(pid: int) -> int | None:
    """A child's exit status without reaping it (Popen still gets it): the code, -signal for
    a signalled child, or None while it runs (or once the process context reaped it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def wait_exits(pids: dict[int, int], wait_s: float, poll_s: float) -> dict[int, int | None]:
    """peek_exit of every local rank -> pid, polled every `poll_s` until all have exited or
    `wait_s` has passed; None for those still running."""
    deadline = time.monotonic() + wait_s
    while True:
        codes = {lr: peek_exit(pid) for lr, pid in pids.items()}
        if None not in codes.values() or time.monotonic() >= deadline:
            return codes
        time.sleep(poll_s)


class SupervisedAgent(ElasticAgentBase):
    """LocalElasticAgent whose restarts, kills and stops follow `hooks` (see module doc)."""

    def __init__(
        self,
        spec: Any,
        *,
        hooks: AgentHooks,
        grace_s: float,
        stop_signal: signal.Signals,
        preempt_signals: tuple[signal.Signals, ...],
        hot_max: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, **kwargs)
        self._hot_max = hot_max
        self._hot_gen = 0
        self._hot_store: Any = None
        """The workers' store as this agent uses it: the server itself when this agent hosts
        it for the round (group rank 0, several nodes; this reference keeps it up), else a
        client made at first use."""
        self._hot_store_lost: str | None = None
        """Why the workers' store failed once: every later use would block for its timeout."""
        self._spare = Spare() if hot_max else None
        self._spare_after: tuple[int, float] | None = None
        """(generation, monotonic time of its replacement): the next spare starts once that
        generation stepped."""
        self._verdict_poll_at = 0.0
        self._named_since: dict[int, float] = {}  # pid -> when a hot verdict first named it
        self._stopped_since: dict[int, float] = {}  # pid -> when first seen stopped, forming
        # the workers' own settings: how long a stopped rank is given, and whether to kill it
        self._stopped_limit_s = float(
            watchdog_setting("heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S)
        )
        self._kill_stopped = bool(watchdog_setting("kill_stopped", True))
        self._hooks = hooks
        self._grace_s = grace_s
        self._stop_signal = stop_signal
        self._preempt_signals = preempt_signals
        self._pending_delay = 0.0
        self._roots: dict[int, int] = {}  # local rank -> exit code, as first seen
        self._handled = False
        self.stop_code: int | None = None
        self.attempt_id = ""

    @property
    def restart_count(self) -> int:
        return self.max_restarts - self.remaining_restarts

    # ------------------------------------------------------------------ start
    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._hot_store = None  # the last round's server, if this agent hosted it, closes
        self.attempt_id, store_addr = self._agree_round(worker_group)
        os.environ[ENV_ATTEMPT] = self.attempt_id  # inherited by the workers' environment
        if store_addr:
            os.environ[ENV_STORE] = store_addr
        else:
            os.environ.pop(ENV_STORE, None)
        self._roots = {}
        self._handled = False
        self._hot_gen, self._hot_store_lost = 0, None
        self._spare_after = None
        self._verdict_poll_at, self._named_since, self._stopped_since = 0.0, {}, {}
        pids = super().start_workers(worker_group)
        if self._spare is not None:
            self._spare.start()  # warm while the group trains: a replacement in waiting
        self._hooks.on_start(
            restart=self.restart_count,
            attempt_id=self.attempt_id,
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
            group_rank=int(worker_group.group_rank or 0),
            pids=list(pids.values()),
        )
        return pids

    def _agree_round(self, worker_group: WorkerGroup) -> tuple[str, str]:
        """The attempt id and the workers' store address ("" for torch's own) that every
        agent of this rendezvous round uses; the agent of group rank 0 decides both.

        The store: where torch would have worker rank 0 host the workers' store (several
        nodes, TORCH_DISABLE_SHARE_RDZV_TCP_STORE: docs/internals.md#g-rdzv-shared-store),
        this agent hosts one instead, fresh for the round (`_host_round_store`). A store in a
        worker dies with it, and with it the group's way to re-form: the loss of worker rank
        0 could only go cold. The workers find it in ENV_STORE."""
        store = worker_group.store
        if store is None:
            return f"r{self.restart_count}", ""
        # The dynamic (c10d, etcd) rendezvous hands out a store prefixed by its round, fresh
        # each round; the static one reuses its store, where restart counts agree anyway.
        static = worker_group.spec.rdzv_handler.get_backend() == "static"
        key = f"{_ROUND_KEY}/{self.restart_count}" if static else _ROUND_KEY
        if worker_group.group_rank == 0:
            attempt = f"r{self.restart_count}-{uuid.uuid4().hex[:8]}"
            addr = self._host_round_store(worker_group)
            store.set(key, json.dumps({"attempt": attempt, "store": addr}))
        agreed = json.loads(bytes(store.get(key)))
        return str(agreed["attempt"]), str(agreed["store"])

    def _host_round_store(self, worker_group: WorkerGroup) -> str:
        """Start this round's workers' store in this process, where the workers would host it
        otherwise; returns its "host:port", or "" when torch's agent store serves already."""
        if worker_group.spec.rdzv_handler.use_agent_store:
            return ""
        from torch.distributed import TCPStore

        host = str(worker_group.master_addr)  # this node's address, as the rendezvous gave it
        self._hot_store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return f"{host}:{self._hot_store.port}"

    # ------------------------------------------------------------------ monitor
    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._spare_after is not None:
            self._start_spare_when_stepped(worker_group)
        pids = self.worker_pids()
        if pids is not None and self._hot_max and not self._roots:
            self._kill_named(worker_group, pids)
        if pids is not None and not self._roots:
            codes = {lr: peek_exit(pid) for lr, pid in pids.items()}
            failed = {lr: c for lr, c in codes.items() if c is not None and c != 0}
            if failed and self._hot_max and self._hot_replace(worker_group, codes, failed):
                failed = {}
            if failed:
                self._roots = failed
                alive = [lr for lr, c in codes.items() if c is None]
                if alive:
                    self._stop_survivors(pids, alive, failed)
        result = super().monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return self._after_failure(worker_group, result)
        return result

    def _hot_replace(
        self, worker_group: WorkerGroup, codes: dict[int, int | None], failed: dict[int, int]
    ) -> bool:
        """Replace the one failed worker of a running group in place; False (with a
        `recovery.cold` event, unless it was a preemption) when the group must restart."""
        if any(c == ExitCode.PREEMPTED for c in failed.values()):
            return False  # a coordinated stop, not a lost process
        t0 = time.monotonic()
        (lr, code), *_ = failed.items()
        reason = None
        if len(failed) > 1:
            reason = f"{len(failed)} workers failed at once"
        elif all(c is not None for c in codes.values()) and not self._other_nodes(worker_group):
            reason = "no surviving worker"
        else:
            reason = self._forming_reason(worker_group)  # also catches up with other nodes
        if reason is None and self._hot_gen >= self._hot_max:
            reason = f"{self._hot_gen} hot recoveries in this attempt (--hot-max)"
        gen = self._hot_gen + 1
        if reason is None:
            reason = self._claim_generation(worker_group, gen)
        rank = worker_group.workers[lr].global_rank
        if reason is not None:
            self._hooks.on_event(
                ev.RECOVERY_COLD, reason=reason, rank=rank, local_rank=lr, exit_code=code
            )
            return False
        try:
            pid, warm = self.replace_worker(lr, {ENV_GENERATION: str(gen)}, self._spare)
        except Exception as e:
            # generation `gen` is published and never forms: the survivors time out and exit,
            # here at once (the caller stops them) and on other nodes within hot.WAIT_S
            self._hooks.on_event(
                ev.RECOVERY_COLD,
                reason=f"the replacement did not start: {e}",
                rank=rank,
                local_rank=lr,
                exit_code=code,
            )
            return False
        worker_group.workers[lr].id = pid  # torch's monitor checks the group's pids
        with contextlib.suppress(Exception):  # a record for people; nothing reads it
            self._hot_workers_store(worker_group).set(
                f"{self._hot_prefix()}/gen_{gen}/replaced", str(rank)
            )
        self._hooks.on_event(
            ev.RECOVERY_HOT_REPLACE,
            rank=rank,
            local_rank=lr,
            exit_code=code,
            generation=gen,
            pid=pid,
            warm_spare=warm,
            seconds=round(time.monotonic() - t0, 4),
        )
        if self._spare is not None:  # the next one, once the new generation made a step
            self._spare_after = (gen, time.monotonic())
        return True

    def _start_spare_when_stepped(self, worker_group: WorkerGroup) -> None:
        """Start the next spare once the generation of the last hot replacement completed its
        first step (rank 0 marks it in the store: runtime/hot.py), or `_SPARE_DEFER_MAX_S`
        after the replacement. A spare's start is seconds of one core (python, torch's
        import); started at the replacement, as before, it took a core from the ranks while
        they re-formed and ran their first step: on a 2-core host with FSDP2 the first step
        after a kill -9 took 0.55 s median instead of 0.42 s without it (docs/benchmarks.md).
        A loss before the spare is ready is still replaced hot, by a fresh process."""
        assert self._spare is not None and self._spare_after is not None
        gen, replaced_at = self._spare_after
        try:
            key = f"{self._hot_prefix()}/gen_{gen}/stepped"
            stepped = bool(self._hot_workers_store(worker_group).check([key]))
        except Exception:  # the store is gone: no reason left to wait
            stepped = True
        since = time.monotonic() - replaced_at
        if stepped or since >= _SPARE_DEFER_MAX_S:
            self._spare_after = None
            self._spare.start()
            self._hooks.on_event(
                ev.RECOVERY_HOT_SPARE,
                generation=gen,
                after_first_step=stepped,
                since_replace_s=round(since, 3),
            )

    @staticmethod
    def _other_nodes(worker_group: WorkerGroup) -> bool:
        """Workers of this group run on other nodes too (their agents watch them)."""
        workers = worker_group.workers
        return bool(workers) and workers[0].world_size > len(workers)

    def _hot_prefix(self) -> str:
        return hot_store_prefix(self.attempt_id)

    def _catch_up(self, store: Any) -> None:
        """Go on from the newest generation published in the workers' store (by any node's
        agent)."""
        key = f"{self._hot_prefix()}/gen"
        if store.check([key]):
            self._hot_gen = max(self._hot_gen, int(bytes(store.get(key))))

    def _current_verdict(self, store: Any) -> dict[str, Any] | None:
        """The verdict the workers' watchdog published in the current generation, if any."""
        key = f"{worker_store_prefix(self.attempt_id, self._hot_gen)}/{WATCHDOG_PREFIX}/verdict"
        return json.loads(bytes(store.get(key))) if store.check([key]) else None

    def _claim_generation(self, worker_group: WorkerGroup, gen: int) -> str | None:
        """Publish generation `gen` for the survivors, unless another node's agent published
        one first (two nodes each lost a worker at once: the group goes cold). Returns why
        not, or None once published. The workers wait for this key (hot.await_generation)."""
        try:
            store = self._hot_workers_store(worker_group)
            previous = str(gen - 1) if gen > 1 else ""
            now = bytes(store.compare_set(f"{self._hot_prefix()}/gen", previous, str(gen)))
        except Exception as e:
            self._hot_store_lost = self._hot_store_lost or str(e)[:300]
            return f"the workers' store is unreachable: {self._hot_store_lost}"
        if now.decode() != str(gen):
            return f"another node published generation {now.decode()} at the same time"
        self._hot_gen = gen
        return None

    def _kill_named(self, worker_group: WorkerGroup, pids: dict[int, int]) -> None:
        """SIGKILL this node's worker that the current generation's hot verdict names, when it
        cannot leave by itself: at once when it went silent (stopped, or its threads never
        run), after _NAMED_EXIT_GRACE_S when it stalled (its watchdog thread exits it). The
        rank that found it kills it too when both share a host (runtime/verdict.py); on
        another node nobody else can, and the survivors would wait out hot.WAIT_S and go
        cold. Polls every _VERDICT_POLL_S; stops once the store fails (a lost store host
        ends the group anyway, and each failed look would block this loop)."""
        if self._hot_store_lost is not None:
            return
        now = time.monotonic()
        if now < self._verdict_poll_at:
            return
        self._verdict_poll_at = now + _VERDICT_POLL_S
        reached = self._hot_store is not None
        try:
            store = self._hot_workers_store(worker_group)
            self._catch_up(store)
            verdict = self._current_verdict(store)
        except Exception as e:
            if reached:
                self._hot_store_lost = str(e)[:300]
            else:  # not up yet: a worker of this round may host it (a user's own group)
                self._verdict_poll_at = now + 1.0
            return
        if self._hot_gen and not verdict:
            self._kill_stopped_on_arrival(store, worker_group, pids, now)
        if not verdict or not verdict.get("hot"):
            return
        local = {w.global_rank: w.local_rank for w in worker_group.workers}
        for rank in verdict.get("ranks", ()):
            pid = pids.get(local.get(rank, -1))
            if pid is None or peek_exit(pid) is not None:
                continue
            first = self._named_since.setdefault(pid, now)
            if first == float("inf"):  # killed already
                continue
            if verdict.get("kind") != "no_heartbeat" and now - first < _NAMED_EXIT_GRACE_S:
                continue
            self._kill_worker(pid, rank, verdict.get("kind"), verdict.get("reason"))

    def _kill_stopped_on_arrival(
        self, store: Any, worker_group: WorkerGroup, pids: dict[int, int], now: float
    ) -> None:
        """While generation g >= 1 forms: SIGKILL this node's worker that has not arrived at
        its roll call (runtime/hot.py, roll_call) and has been stopped for
        `heartbeat_timeout_s`. Its peers tell a stopped rank from a slow one only on its own
        host (the process state); from another host they would wait `startup_timeout_s`
        (15 min by default). The kill is a failure while the generation forms: this node
        goes cold, and the others follow it into the next rendezvous round."""
        if not self._kill_stopped:
            return
        arrived = f"{self._hot_prefix()}/gen_{self._hot_gen}/arrived"
        if store.check([f"{arrived}/all"]):
            self._stopped_since = {}
            return
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if pid is None or pid in self._named_since:
                continue
            if store.check([f"{arrived}/{w.global_rank}"]) or not _is_stopped(pid):
                self._stopped_since.pop(pid, None)
                continue
            first = self._stopped_since.setdefault(pid, now)
            if now - first < self._stopped_limit_s:
                continue
            why = f"stopped for {now - first:.1f} s without arriving for generation {self._hot_gen}"
            self._kill_worker(pid, w.global_rank, "roll_call", why)

    def _kill_worker(self, pid: int, rank: int, kind: Any, reason: Any) -> None:
        """SIGKILL this node's worker `pid` (once: `_named_since` marks it) and say why."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # each worker leads its own session
        self._named_since[pid] = float("inf")
        self._hooks.on_event(
            ev.RECOVERY_HOT_KILL,
            rank=rank,
            pid=pid,
            kind=kind,
            reason=reason,
            generation=self._hot_gen,
        )

    def _forming_reason(self, worker_group: WorkerGroup) -> str | None:
        """Why a failure now must go cold for the store's sake: the current generation is
        still forming, the workers stop the group together, or the store is unreachable;
        None when none of these."""
        try:
            store = self._hot_workers_store(worker_group)
            self._catch_up(store)
            formed = f"{self._hot_prefix()}/gen_{self._hot_gen}/formed"
            if self._hot_gen and not store.check([formed]):
                return f"a failure while generation {self._hot_gen} was still forming"
            # a verdict for the whole group (not a hot one, which names one rank to replace):
            # its ranks exit one by one, and the first one out is no lost process to replace
            verdict = self._current_verdict(store)
            if verdict is not None and not verdict.get("hot"):
                return f"the workers' verdict stops the group: {verdict.get('reason')}"
        except Exception as e:  # the store is gone: nothing can re-form through it
            self._hot_store_lost = self._hot_store_lost or str(e)[:300]
            return f"the workers' store is unreachable: {self._hot_store_lost}"
        return None

    def _hot_workers_store(self, worker_group: WorkerGroup) -> Any:
        """The store the workers use: this agent's own for the round, or a client of it (the
        round's ENV_STORE, else MASTER_ADDR:MASTER_PORT of the workers' env)."""
        if self._hot_store_lost is not None:
            raise RuntimeError(self._hot_store_lost)
        if self._hot_store is None:
            from datetime import timedelta

            from torch.distributed import TCPStore

            address = hosted_store()  # set by start_workers for the round
            if address is None:
                env = self.worker_env(worker_group.workers[0].local_rank)
                address = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            self._hot_store = TCPStore(
                *address,
                is_master=False,
                timeout=timedelta(seconds=_STORE_TIMEOUT_S),
                wait_for_workers=False,
            )
        return self._hot_store

    def _stop_survivors(
        self, pids: dict[int, int], alive: list[int], failed: dict[int, int]
    ) -> None:
        if all(c == ExitCode.PREEMPTED for c in failed.values()):
            # a coordinated stop: the others are committing the same checkpoint and leaving
            # no scheduler deadline here (the launcher got no signal): at least a few seconds
            wait_s = max(self._grace_s, 5.0)
            self._hooks.on_event("preempt.wait_ranks", local_ranks=alive, wait_s=wait_s)
            codes = wait_exits({lr: pids[lr] for lr in alive}, wait_s, 0.05)
            alive = [lr for lr, c in codes.items() if c is None]
            if not alive:
                return
        self._hooks.on_event(
            "restart.kill_survivors",
            local_ranks=alive,
            first_failures={str(lr): c for lr, c in failed.items()},
        )
        for lr in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pids[lr], signal.SIGKILL)  # each worker leads its own session
        wait_exits({lr: pids[lr] for lr in alive}, 2.0, 0.01)  # gone before torch polls them

    def _say_cold(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """A worker died between this agent's look and torch elastic's own poll, which has
        already stopped the group (SIGTERM to the rest): the recovery is cold. Say why, as
        `_hot_replace` would have, and mark the first failures as the roots."""
        codes = {pf.local_rank: pf.exitcode for pf in result.failures.values()}
        # torch's own SIGTERMs are not causes, unless nothing else failed
        roots = {lr: c for lr, c in codes.items() if c != -signal.SIGTERM} or codes
        if not roots or any(c == ExitCode.PREEMPTED for c in roots.values()):
            return
        self._roots = roots
        (lr, code), *_ = roots.items()
        reason = f"{len(roots)} workers failed at once" if len(roots) > 1 else None
        if reason is None and self._hot_gen:
            reason = self._forming_reason(worker_group)
        if reason is None:
            reason = "torch elastic's monitor saw the failure first and stopped the group"
        rank = worker_group.workers[lr].global_rank
        self._hooks.on_event(
            ev.RECOVERY_COLD, reason=reason, rank=rank, local_rank=lr, exit_code=code
        )

    def _after_failure(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        if self._handled:  # the loop polls a finished group again before restarting it
            return result
        self._handled = True
        if self._hot_max and not self._roots:
            self._say_cold(worker_group, result)
        failures = []
        for rank, pf in sorted(result.failures.items()):
            msg = pf.message
            if isinstance(msg, dict):  # error files hold {"message": ..., "extraInfo": ...}
                msg = str(msg.get("message", ""))
            failures.append(
                FailureInfo(
                    rank=rank,
                    local_rank=pf.local_rank,
                    pid=pf.pid,
                    exit_code=pf.exitcode,
                    error_file_message=msg if pf.error_file != "<N/A>" and msg else None,
                    root=pf.local_rank in self._roots if self._roots else True,
                )
            )
        try:
            waiting = worker_group.spec.rdzv_handler.num_nodes_waiting()
        except Exception:  # the rendezvous store may be gone with a failed node
            waiting = 0
        verdict = self._hooks.on_failure(
            restart=self.restart_count,
            failures=failures,
            restarts_left=self.remaining_restarts,
            nodes_waiting=waiting,
        )
        if verdict.action == "rejoin":
            # the agent's own membership-change path: restart, not counted as a failure
            return RunResult(state=WorkerState.HEALTHY)
        if verdict.action == "stop":
            self.stop_code = verdict.code
            self.remaining_restarts = 0
        else:
            self._pending_delay = verdict.delay_s
        return result

    # ------------------------------------------------------------------ stop
    def stop_workers(self, worker_group: WorkerGroup) -> None:
        self._spare_after = None
        if self._spare is not None:
            self._spare.stop()
        if worker_group.state == WorkerState.HEALTHY:
            # a membership change: the group is fine; let it save and leave
            self._hooks.on_event("restart.membership", grace_s=self._grace_s)
            super().shutdown(self._stop_signal, timeout=int(self._grace_s + 0.999))
        else:
            super().shutdown(signal.SIGKILL, timeout=30)
        delay, self._pending_delay = self._pending_delay, 0.0
        if delay > 0:
            self._hooks.on_event("restart.backoff", delay_s=round(delay, 3))
            time.sleep(delay)

    def shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self._spare_after = None
        if self._spare is not None:
            self._spare.stop()
        if isinstance(sys.exc_info()[1], SignalException) and death_sig in self._preempt_signals:
            # run() is forwarding a signal the launcher got: the workers have the grace period
            # to commit; a repeated signal (Slurm signals every process of the step) must not
            # cut it short
            for sig in self._preempt_signals:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(sig, signal.SIG_IGN)
            self._hooks.on_event("preempt.forward", signal=death_sig.name, grace_s=timeout)
        elif isinstance(sys.exc_info()[1], (RendezvousError, DistError)):
            self._after_rendezvous_lost()
        super().shutdown(death_sig, timeout)

    def _after_rendezvous_lost(self) -> None:
        """The rendezvous store went away under a running group. At the end of a coordinated
        stop this is a race, not a failure: the node hosting the store committed, exited and
        took the store with it while this node's workers were still leaving. They get the
        grace period to leave on their own (peers on a lost node make training workers fail
        within seconds); if every one left with PREEMPTED, so does this node."""
        codes = wait_exits(self.worker_pids() or {}, self._grace_s, 0.05)
        if codes and all(c == ExitCode.PREEMPTED for c in codes.values()):
            self.stop_code = int(ExitCode.PREEMPTED)
            self._hooks.on_event("preempt.rendezvous_gone", local_ranks=sorted(codes))


def _is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, or stopped by a tracer)."""
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
