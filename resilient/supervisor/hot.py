"""The supervisor agent's side of hot recovery (`resilient run --hot-recovery`, `hot_max` > 0).

When exactly one local worker dies and the group is not already recovering, the agent
(agent.py) leaves the others running and `HotReplacer` puts one new process in the dead one's
local rank (the agent's `replace_worker`, from a warm spare when one is ready: spare.py) with
the next generation, which it publishes on the workers' store for the survivors, who re-run
their script in place (resilient/hot/recovery.py). Anything else, or a failure while a
generation is still forming, goes cold: the agent's restart path, with a `recovery.cold`
event saying why.

On several nodes the generations are the store's, not one agent's: each agent claims the next
one there (compare-and-set), and a node's agent SIGKILLs its own worker when a hot verdict
names it and it cannot leave by itself (stopped, or silent), since the rank that found it may
sit on another node and cannot reach the process (`kill_named`).

It lives apart from the agent's torch elastic lifecycle (rendezvous round, start, monitor,
restart), which hands it what it needs and asks it at each look at the group; every key it
reads or writes is built in resilient/storekeys.py, shared with the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from resilient import events as ev
from resilient import storekeys
from resilient.envvars import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    ENV_GENERATION,
    hosted_store,
    watchdog_setting,
)
from resilient.exitcodes import ExitCode
from resilient.supervisor.procs import is_stopped, peek_exit
from resilient.supervisor.spare import Spare

__all__ = ["HotReplacer"]

_SPARE_DEFER_MAX_S = 30.0
"""How long after a hot replacement the next spare may wait for the new generation's first
step (then it starts anyway): see HotReplacer.start_spare_when_stepped."""
_VERDICT_POLL_S = 0.25
"""How often an agent under hot recovery looks for a hot verdict naming one of its workers."""
_STORE_TIMEOUT_S = 2.0
"""The agent's calls to the workers' store: milliseconds when it is up; torch's client retries
a refused connection until this timeout, so a store whose host died costs it once."""
_NAMED_EXIT_GRACE_S = 10.0
"""How long a worker named by a hot verdict for a stall (its watchdog thread still runs: it
dumps its stacks and exits by itself) may take before its agent SIGKILLs it."""


_STOPS = frozenset({int(ExitCode.NUMERICAL_FAULT), int(ExitCode.MISMATCH)})
"""Exit codes that stop the run: a restart, hot or cold, would meet the same cause again."""


class HotReplacer:
    """One agent's hot recoveries within a rendezvous round (see module doc).

    `replace_worker(local_rank, extra_env, spare) -> (pid, warm)` and `worker_env(local_rank)`
    are the agent's (supervisor/_torch_compat.py); `on_event` its hooks'."""

    def __init__(
        self,
        *,
        hot_max: int,
        on_event: Callable[..., None],
        replace_worker: Callable[[int, dict[str, str], Any], tuple[int, bool]],
        worker_env: Callable[[int], dict[str, str]],
    ) -> None:
        self._hot_max = hot_max
        self._on_event = on_event
        self._replace_worker = replace_worker
        self._store = WorkersStore(worker_env)
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

    @property
    def enabled(self) -> bool:
        return self._hot_max > 0

    def drop_store(self) -> None:
        self._store.drop()

    def start_round(self, attempt_id: str, hosted: Any) -> None:
        """A new round of `attempt_id` (its workers' store: WorkersStore.start_round)."""
        self._store.start_round(attempt_id, hosted)
        self._spare_after = None
        self._verdict_poll_at, self._named_since, self._stopped_since = 0.0, {}, {}

    def start_spare(self) -> None:
        if self._spare is not None:
            self._spare.start()  # warm while the group trains: a replacement in waiting

    def stop_spare(self) -> None:
        self._spare_after = None
        if self._spare is not None:
            self._spare.stop()

    def replace(
        self, worker_group: WorkerGroup, codes: dict[int, int | None], failed: dict[int, int]
    ) -> bool:
        """Replace the one failed worker of a running group in place; False (with a
        `recovery.cold` event, unless it was a preemption or a numerical fault, which are no
        lost process) when the group must restart or stop."""
        if any(c == ExitCode.PREEMPTED for c in failed.values()):
            return False  # a coordinated stop, not a lost process
        if any(c in _STOPS for c in failed.values()):
            return False  # not a lost process either: the run stops (hooks.py)
        t0 = time.monotonic()
        (lr, code), *_ = failed.items()
        reason = None
        if len(failed) > 1:
            reason = f"{len(failed)} workers failed at once"
        elif all(c is not None for c in codes.values()) and not _other_nodes(worker_group):
            reason = "no surviving worker"
        else:
            reason = self._store.forming_reason(worker_group)  # also catches up with other nodes
        if reason is None and self._store.generation >= self._hot_max:
            reason = f"{self._store.generation} hot recoveries in this attempt (--hot-max)"
        gen = self._store.generation + 1
        if reason is None:
            reason = self._store.claim(worker_group, gen)
        rank = worker_group.workers[lr].global_rank
        if reason is not None:
            self._on_event(
                ev.RECOVERY_COLD, reason=reason, rank=rank, local_rank=lr, exit_code=code
            )
            return False
        try:
            pid, warm = self._replace_worker(lr, {ENV_GENERATION: str(gen)}, self._spare)
        except Exception as e:
            # generation `gen` is published and never forms: the survivors time out and exit,
            # here at once (the caller stops them) and on other nodes within HotMode.wait_s
            # (resilient/envvars.py)
            self._on_event(
                ev.RECOVERY_COLD,
                reason=f"the replacement did not start: {e}",
                rank=rank,
                local_rank=lr,
                exit_code=code,
            )
            return False
        worker_group.workers[lr].id = pid  # torch's monitor checks the group's pids
        with contextlib.suppress(Exception):  # a record for people; nothing reads it
            self._store.get(worker_group).set(self._store.keys.replaced(gen), str(rank))
        self._on_event(
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

    def start_spare_when_stepped(self, worker_group: WorkerGroup) -> None:
        """Start the next spare once the generation of the last hot replacement completed its
        first step (rank 0 marks it in the store: hot/recovery.py), or `_SPARE_DEFER_MAX_S`
        after the replacement. A spare's start is seconds of one core (python, torch's
        import); started at the replacement, as before, it took a core from the ranks while
        they re-formed and ran their first step: on a 2-core host with FSDP2 the first step
        after a kill -9 took 0.55 s median instead of 0.42 s without it
        (docs/benchmarks-history.md).
        A loss before the spare is ready is still replaced hot, by a fresh process."""
        if self._spare_after is None:
            return
        assert self._spare is not None
        gen, replaced_at = self._spare_after
        try:
            key = self._store.keys.stepped(gen)
            stepped = bool(self._store.get(worker_group).check([key]))
        except Exception:  # the store is gone: no reason left to wait
            stepped = True
        since = time.monotonic() - replaced_at
        if stepped or since >= _SPARE_DEFER_MAX_S:
            self._spare_after = None
            self._spare.start()
            self._on_event(
                ev.RECOVERY_HOT_SPARE,
                generation=gen,
                after_first_step=stepped,
                since_replace_s=round(since, 3),
            )

    def watchdog_store(self, worker_group: WorkerGroup) -> tuple[Any, str]:
        """The workers' store and the current generation's watchdog prefix (stopped.py)."""
        store = self._store.get(worker_group)
        self._store.catch_up(store)
        return store, storekeys.watchdog_prefix(self._store.attempt_id, self._store.generation)

    def kill_named(self, worker_group: WorkerGroup, pids: dict[int, int]) -> None:
        """SIGKILL this node's worker that the current generation's hot verdict names, when it
        cannot leave by itself: at once when it went silent (stopped, or its threads never
        run), after _NAMED_EXIT_GRACE_S when it stalled (its watchdog thread exits it). The
        rank that found it kills it too when both share a host (hang/verdict.py); on
        another node nobody else can, and the survivors would wait out HotMode.wait_s
        (resilient/envvars.py) and go cold. Polls every _VERDICT_POLL_S; stops once the store
        fails (a lost store host ends the group anyway, and each failed look would block the
        agent's loop)."""
        if self._store.lost is not None:
            return
        now = time.monotonic()
        if now < self._verdict_poll_at:
            return
        self._verdict_poll_at = now + _VERDICT_POLL_S
        reached = self._store.reached
        try:
            store = self._store.get(worker_group)
            self._store.catch_up(store)
            verdict = self._store.current_verdict(store)
        except Exception as e:
            if reached:
                self._store.lost = str(e)[:300]
            else:  # not up yet: a worker of this round may host it (a user's own group)
                self._verdict_poll_at = now + 1.0
            return
        if self._store.generation and not verdict:
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
        its roll call (hot/recovery.py, roll_call) and has been stopped for
        `heartbeat_timeout_s`. Its peers tell a stopped rank from a slow one only on its own
        host (the process state); from another host they would wait `startup_timeout_s`
        (15 min by default). The kill is a failure while the generation forms: this node
        goes cold, and the others follow it into the next rendezvous round."""
        if not self._kill_stopped:
            return
        keys, gen = self._store.keys, self._store.generation
        if store.check([keys.arrived(gen, "all")]):
            self._stopped_since = {}
            return
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if pid is None or pid in self._named_since:
                continue
            if store.check([keys.arrived(gen, w.global_rank)]) or not is_stopped(pid):
                self._stopped_since.pop(pid, None)
                continue
            first = self._stopped_since.setdefault(pid, now)
            if now - first < self._stopped_limit_s:
                continue
            why = f"stopped for {now - first:.1f} s without arriving for generation {gen}"
            self._kill_worker(pid, w.global_rank, "roll_call", why)

    def _kill_worker(self, pid: int, rank: int, kind: Any, reason: Any) -> None:
        """SIGKILL this node's worker `pid` (once: `_named_since` marks it) and say why."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # each worker leads its own session
        self._named_since[pid] = float("inf")
        self._on_event(
            ev.RECOVERY_HOT_KILL,
            rank=rank,
            pid=pid,
            kind=kind,
            reason=reason,
            generation=self._store.generation,
        )

    def say_cold(self, worker_group: WorkerGroup, result: RunResult) -> dict[int, int]:
        """A worker died between the agent's look and torch elastic's own poll, which has
        already stopped the group (SIGTERM to the rest): the recovery is cold. Say why, as
        `replace` would have; returns the first failures, the roots ({} when there were none
        to name, or it was a preemption)."""
        codes = {pf.local_rank: pf.exitcode for pf in result.failures.values()}
        # torch's own SIGTERMs are not causes, unless nothing else failed
        roots = {lr: c for lr, c in codes.items() if c != -signal.SIGTERM} or codes
        if not roots or any(c == ExitCode.PREEMPTED for c in roots.values()):
            return {}
        if any(c in _STOPS for c in roots.values()):
            return roots  # no recovery at all: the run stops (hooks.py)
        (lr, code), *_ = roots.items()
        reason = f"{len(roots)} workers failed at once" if len(roots) > 1 else None
        if reason is None and self._store.generation:
            reason = self._store.forming_reason(worker_group)
        if reason is None:
            reason = "torch elastic's monitor saw the failure first and stopped the group"
        rank = worker_group.workers[lr].global_rank
        self._on_event(ev.RECOVERY_COLD, reason=reason, rank=rank, local_rank=lr, exit_code=code)
        return roots


class WorkersStore:
    """The workers' store of one rendezvous round as the agent's hot recovery uses it: the
    generations published there (by any node's agent) and the workers' verdict. Once a call
    fails the store counts as lost (`lost`): every later use would block for its timeout."""

    def __init__(self, worker_env: Callable[[int], dict[str, str]]) -> None:
        self._worker_env = worker_env
        self.attempt_id = ""
        self.generation = 0
        """The newest generation this agent published or saw published."""
        self.lost: str | None = None
        """Why the workers' store failed once."""
        self._store: Any = None
        """The server itself when the agent hosts it for the round (group rank 0, several
        nodes; this reference keeps it up), else a client made at first use."""

    def start_round(self, attempt_id: str, hosted: Any) -> None:
        """A new round of `attempt_id`, whose store the agent hosts (`hosted`) or not (None:
        a client is made at first use); no generation yet."""
        self.attempt_id = attempt_id
        if hosted is not None:
            self._store = hosted
        self.generation, self.lost = 0, None

    def drop(self) -> None:
        """Forget the last round's store: the server, if the agent hosted it, closes."""
        self._store = None

    @property
    def reached(self) -> bool:
        """A server or client is at hand (it was reached once, or the agent hosts it)."""
        return self._store is not None

    def get(self, worker_group: WorkerGroup) -> Any:
        """The store the workers use: the agent's own for the round, or a client of it (the
        round's ENV_STORE, else MASTER_ADDR:MASTER_PORT of the workers' env)."""
        if self.lost is not None:
            raise RuntimeError(self.lost)
        if self._store is None:
            from datetime import timedelta

            from torch.distributed import TCPStore

            address = hosted_store()  # set by the agent's start_workers for the round
            if address is None:
                env = self._worker_env(worker_group.workers[0].local_rank)
                address = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            self._store = TCPStore(
                *address,
                is_master=False,
                timeout=timedelta(seconds=_STORE_TIMEOUT_S),
                wait_for_workers=False,
            )
        return self._store

    @property
    def keys(self) -> storekeys.HotKeys:
        return storekeys.HotKeys(self.attempt_id)

    def catch_up(self, store: Any) -> None:
        """Go on from the newest generation published in the workers' store (by any node's
        agent)."""
        key = self.keys.published()
        if store.check([key]):
            self.generation = max(self.generation, int(bytes(store.get(key))))

    def current_verdict(self, store: Any) -> dict[str, Any] | None:
        """The verdict the workers' watchdog published in the current generation, if any."""
        key = storekeys.watchdog_key(self.attempt_id, self.generation, storekeys.VERDICT)
        return json.loads(bytes(store.get(key))) if store.check([key]) else None

    def claim(self, worker_group: WorkerGroup, gen: int) -> str | None:
        """Publish generation `gen` for the survivors, unless another node's agent published
        one first (two nodes each lost a worker at once: the group goes cold). Returns why
        not, or None once published. The workers wait for this key (resilient/hot/reform.py,
        await_generation)."""
        try:
            store = self.get(worker_group)
            previous = str(gen - 1) if gen > 1 else ""
            now = bytes(store.compare_set(self.keys.published(), previous, str(gen)))
        except Exception as e:
            self.lost = self.lost or str(e)[:300]
            return f"the workers' store is unreachable: {self.lost}"
        if now.decode() != str(gen):
            return f"another node published generation {now.decode()} at the same time"
        self.generation = gen
        return None

    def forming_reason(self, worker_group: WorkerGroup) -> str | None:
        """Why a failure now must go cold for the store's sake: the current generation is
        still forming, the workers stop the group together, or the store is unreachable;
        None when none of these."""
        try:
            store = self.get(worker_group)
            self.catch_up(store)
            formed = self.keys.formed(self.generation)
            if self.generation and not store.check([formed]):
                return f"a failure while generation {self.generation} was still forming"
            # a verdict for the whole group (not a hot one, which names one rank to replace):
            # its ranks exit one by one, and the first one out is no lost process to replace
            verdict = self.current_verdict(store)
            if verdict is not None and not verdict.get("hot"):
                return f"the workers' verdict stops the group: {verdict.get('reason')}"
        except Exception as e:  # the store is gone: nothing can re-form through it
            self.lost = self.lost or str(e)[:300]
            return f"the workers' store is unreachable: {self.lost}"
        return None


def _other_nodes(worker_group: WorkerGroup) -> bool:
    """Workers of this group run on other nodes too (their agents watch them)."""
    workers = worker_group.workers
    return bool(workers) and workers[0].world_size > len(workers)
