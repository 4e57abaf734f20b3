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
  worker dies and the group is not already recovering, the others are left running and one
  new process takes the dead one's local rank with the next generation (hot.py, HotReplacer,
  which this agent asks at each look at the group). Anything else, or a failure while a
  generation is still forming, takes the restart path below, with a `recovery.cold` event
  saying why.
- Before every round after a restart the node's gate (gate.py: health checks, straggler
  eviction) may say this node leaves: NodeLeaves ends the agent's loop without a rendezvous.
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

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousError

from resilient import faultpoints, storekeys
from resilient.envvars import ENV_ATTEMPT, ENV_STORE
from resilient.exitcodes import ExitCode
from resilient.supervisor._torch_compat import ElasticAgentBase
from resilient.supervisor.gate import NodeGate
from resilient.supervisor.hot import HotReplacer
from resilient.supervisor.procs import kill_leftovers, peek_exit, wait_exits
from resilient.supervisor.startwatch import StartWatch
from resilient.supervisor.stopped import StoppedWorkers

__all__ = ["AgentHooks", "FailureInfo", "SupervisedAgent", "Verdict"]


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

    def not_started(self, restart: int, ranks: list[int]) -> dict[int, str | None]: ...


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
        gate: NodeGate | None = None,
        start_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, **kwargs)
        self._gate = gate
        self._start = StartWatch(start_timeout_s)
        self._hot = HotReplacer(
            hot_max=hot_max,
            on_event=hooks.on_event,
            replace_worker=self.replace_worker,
            worker_env=self.worker_env,
        )
        """Hot recovery, and the workers' store of the round (which it holds: see
        _host_round_store)."""
        self._stopped = StoppedWorkers(
            self._hot.watchdog_store, hooks.on_event, hot=lambda: self._hot.enabled
        )
        """Names a stopped or zombie worker of this node in seconds (stopped.py)."""
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
        self._hot.drop_store()  # the last round's server, if this agent hosted it, closes
        self.attempt_id, store_addr, hosted = self._agree_round(worker_group)
        os.environ[ENV_ATTEMPT] = self.attempt_id  # inherited by the workers' environment
        if store_addr:
            os.environ[ENV_STORE] = store_addr
            if worker_group.spec.rdzv_handler.use_agent_store:
                # what a script's own init_process_group("gloo") connects to: the round's
                # fresh store, not torch's shared one, which keeps the last attempt's keys
                host, port = store_addr.rsplit(":", 1)
                worker_group.master_addr = host  # type: ignore[assignment]
                worker_group.master_port = int(port)  # type: ignore[assignment]
        else:
            os.environ.pop(ENV_STORE, None)
        self._roots = {}
        self._handled = False
        self._hot.start_round(self.attempt_id, hosted)
        self._stopped.start_round()
        pids = super().start_workers(worker_group)
        self._start.started()
        if self._gate is not None:
            self._gate.started(worker_group.workers[0].world_size if worker_group.workers else 0)
        self._hot.start_spare()
        self._hooks.on_start(
            restart=self.restart_count,
            attempt_id=self.attempt_id,
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
            group_rank=int(worker_group.group_rank or 0),
            pids=list(pids.values()),
        )
        return pids

    def _agree_round(self, worker_group: WorkerGroup) -> tuple[str, str, Any]:
        """The attempt id and the workers' store address ("" for none) that every agent of
        this rendezvous round uses; the agent of group rank 0 decides both, and hosts the
        store (third: the server, else None).

        The store is fresh for the round (`_host_round_store`), whatever torch would do:
        - where torch shares its agent's store with the workers (one node, the default), that
          store outlives the round and keeps the last attempt's keys, which a script's own
          `init_process_group` reads back as its peers' old addresses: the restart dies of
          "Connection refused" or hangs in gloo's connectFullMesh
          (docs/internals.md#g-per-attempt-store). MASTER_ADDR:MASTER_PORT point at the
          fresh store instead (start_workers).
        - where torch would have worker rank 0 host it (several nodes,
          TORCH_DISABLE_SHARE_RDZV_TCP_STORE: docs/internals.md#g-rdzv-shared-store), a
          store in a worker dies with it, and with it the group's way to re-form: the loss of
          worker rank 0 could only go cold.
        The workers find it in ENV_STORE."""
        store = worker_group.store
        if store is None:
            return f"r{self.restart_count}", "", None
        # The dynamic (c10d, etcd) rendezvous hands out a store prefixed by its round, fresh
        # each round; the static one reuses its store, where restart counts agree anyway.
        static = worker_group.spec.rdzv_handler.get_backend() == "static"
        key = storekeys.round_key(self.restart_count if static else None)
        hosted = None
        if worker_group.group_rank == 0:
            attempt = f"r{self.restart_count}-{uuid.uuid4().hex[:8]}"
            addr, hosted = self._host_round_store(worker_group)
            store.set(key, json.dumps({"attempt": attempt, "store": addr}))
        agreed = json.loads(bytes(store.get(key)))
        return str(agreed["attempt"]), str(agreed["store"]), hosted

    def _host_round_store(self, worker_group: WorkerGroup) -> tuple[str, Any]:
        """Start this round's workers' store in this process; returns its "host:port" and
        the server (the agent's HotReplacer holds it for the round: that reference keeps it
        up; the next round's start_workers drops it)."""
        from torch.distributed import TCPStore

        host = str(worker_group.master_addr)  # this node's address, as the rendezvous gave it
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return f"{host}:{server.port}", server

    # ------------------------------------------------------------------ monitor
    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._start.due() and not self._roots:
            self._check_started(worker_group)
        if self._hot.enabled:
            self._hot.start_spare_when_stepped(worker_group)
        pids = self.worker_pids()
        if pids is not None and self._hot.enabled and not self._roots:
            self._hot.kill_named(worker_group, pids)
        if pids is not None and not self._roots:
            self._stopped.look(worker_group, pids)
            codes = {lr: peek_exit(pid) for lr, pid in pids.items()}
            kill_leftovers({lr: pids[lr] for lr, c in codes.items() if c is not None})
            faultpoints.hit(faultpoints.AGENT_LOOKED, pids=dict(pids))
            failed = {lr: c for lr, c in codes.items() if c is not None and c != 0}
            if failed and self._hot.enabled and self._hot.replace(worker_group, codes, failed):
                failed = {}
            if failed:
                self._roots = failed
                alive = [lr for lr, c in codes.items() if c is None]
                if alive:
                    self._stop_survivors(pids, alive, failed)
            elif self._hot.enabled and None in codes.values():
                # Not torch's poll while workers run: its process context SIGTERMs every
                # running worker at the first failed exit it sees. A worker lost since the
                # look above (a stopped rank its peer's watchdog just killed) would then take
                # the survivors down as they await its replacement, and come back as a
                # second failure: cold. The next look (--monitor-interval) replaces it hot.
                return RunResult(state=WorkerState.HEALTHY)
        result = super().monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return self._after_failure(worker_group, result)
        return result

    def _check_started(self, worker_group: WorkerGroup) -> None:
        """The start's deadline passed: kill the workers that have not reached their first
        step (the restart path follows, as after any failure), naming each."""
        pids = self.worker_pids() or {}
        local = {w.global_rank: w.local_rank for w in worker_group.workers}
        stuck = self._hooks.not_started(self.restart_count, sorted(local))
        if not stuck:
            return
        self._hooks.on_event(
            "start.timeout",
            timeout_s=self._start.timeout_s,
            ranks={str(r): ev or "no event: before resilient.init()" for r, ev in stuck.items()},
        )
        self._roots = {local[r]: int(ExitCode.HANG) for r in stuck}
        for r in stuck:
            with contextlib.suppress(ProcessLookupError, PermissionError, KeyError):
                os.killpg(pids[local[r]], signal.SIGKILL)  # each worker leads its own session

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

    def _after_failure(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        if self._handled:  # the loop polls a finished group again before restarting it
            return result
        self._handled = True
        if self._hot.enabled and not self._roots:
            self._roots = self._hot.say_cold(worker_group, result)
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
        self._hot.stop_spare()
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
        if self._gate is not None:
            self._gate.check()  # raises NodeLeaves: this node does not join the next round

    def shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self._hot.stop_spare()
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
