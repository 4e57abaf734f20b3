"""The environment contract between `resilient run` and its workers, in one place.

The launcher (resilient/supervisor/) and the in-worker runtime (resilient/runtime/) never
import each other: the launcher sets the variables named here and the workers read them, and
the workers' exit codes (resilient/exitcodes.py) carry the answer back. This module imports
nothing from torch, so the launcher can use it without loading the worker runtime.

Every variable a worker reads from its environment has its name here, with what sets it and
what it means; the parsing helpers both sides need sit next to them. A job script or the
chaos harness may set the RESILIENT_* ones by hand too; they override defaults, never values
passed explicitly to `resilient.init()`.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from typing import Any

from resilient.errors import ConfigError
from resilient.storekeys import HotKeys

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_SIGNALS",
    "ENV_ATTEMPT",
    "ENV_BATCH_POLICY",
    "ENV_CHECKPOINT_DIR",
    "ENV_FINAL_DIGEST",
    "ENV_GENERATION",
    "ENV_GRACE_S",
    "ENV_HOT",
    "ENV_NUMERIC",
    "ENV_PREEMPT",
    "ENV_PREEMPT_SIGNALS",
    "ENV_RUN_DIR",
    "ENV_RUN_ID",
    "ENV_SCRATCH",
    "ENV_SNAPSHOT",
    "ENV_STOP_AT",
    "ENV_STORE",
    "ENV_UNTESTED_TORCH",
    "ENV_WATCHDOG",
    "HOT_WAIT_S",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "HotMode",
    "hosted_store",
    "int_env",
    "json_object_env",
    "parse_signals",
    "untested_torch_allowed",
    "watchdog_setting",
]

# ---------------------------------------------------------------- resilient's own
ENV_RUN_DIR = "RESILIENT_RUN_DIR"
"""Run directory: per-rank event logs under <dir>/logs, the supervisor's log and report. Set
by `resilient run --run-dir`; a worker without it uses runs/<run id>."""
ENV_CHECKPOINT_DIR = "RESILIENT_CHECKPOINT_DIR"
"""Checkpoint directory or fsspec URL. Set by `resilient run --checkpoint-url`; a worker
without it (and without an explicit URL) uses ./checkpoints."""
ENV_RUN_ID = "RESILIENT_RUN_ID"
"""Run id of a worker started without torch elastic (TORCHELASTIC_RUN_ID wins)."""
ENV_ATTEMPT = "RESILIENT_ATTEMPT"
"""The attempt id every agent of a rendezvous round agreed on; the workers prefix their store
with it (docs/internals.md#g-per-attempt-store). Set by the supervisor's agent before it
starts workers; without it the workers use TORCHELASTIC_RESTART_COUNT."""
ENV_STORE = "RESILIENT_STORE"
"""host:port of the store the group-rank-0 agent hosts for this rendezvous round, set by the
supervisor's agent when torch would have worker rank 0 host it (several nodes:
TORCH_DISABLE_SHARE_RDZV_TCP_STORE). The workers connect to it as clients instead of
MASTER_ADDR:MASTER_PORT, so that losing any worker, rank 0 included, leaves the store up."""
ENV_BATCH_POLICY = "RESILIENT_BATCH_POLICY"
"""How a global batch the loader's batch size cannot split on a new data-parallel degree is
kept: "exact" (the default) or "follow" (RuntimeConfig.batch_policy; set by `resilient run
--batch-policy`; resilient/data/policy.py)."""
ENV_GRACE_S = "RESILIENT_GRACE_S"
"""Seconds from a preemption signal to SIGKILL (set by `resilient run --grace-period`)."""
ENV_PREEMPT_SIGNALS = "RESILIENT_PREEMPT_SIGNALS"
"""Comma-separated signal names that start a coordinated stop; "none" turns handling off. Set
by `resilient run --preempt-signals`."""
ENV_PREEMPT = "RESILIENT_PREEMPT"
"""A JSON object of PreemptConfig fields, e.g. '{"check_interval_s": 0.1}'."""
ENV_WATCHDOG = "RESILIENT_WATCHDOG"
"""JSON object of WatchdogConfig fields that override the defaults (not values passed to
`resilient.init(watchdog=...)`), e.g. '{"timeout_s": 60}'; "0" or "off" disables the watchdog."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
"""WatchdogConfig.heartbeat_timeout_s by default; the agent reads the same setting (a worker
stopped on its way into a hot generation is killed after it)."""

ENV_STOP_AT = "RESILIENT_STOP_AT"
"""Set by `resilient check-resume`: leave steps()/epochs() after this many steps with a
committed checkpoint."""
ENV_FINAL_DIGEST = "RESILIENT_FINAL_DIGEST"
"""Set by `resilient check-resume`: at the end of the loop, log the final state's sha256 (a
collective) as `runtime.digest`."""
ENV_SCRATCH = "RESILIENT_CHECK_SCRATCH"
"""Set by `resilient check-resume`: checkpoints and logs go under this directory whatever the
script passes to init(), so checking never touches the script's own checkpoints."""

ENV_HOT = "RESILIENT_HOT"
"""Hot recovery of a lost process ("1"), set by `resilient run --hot-recovery`: the workers keep
in-memory snapshots, and when one of them dies the others stay alive, re-run the script in
place and continue from their snapshot with a replacement (resilient/hot/recovery.py)."""
ENV_GENERATION = "RESILIENT_GENERATION"
"""The generation of the worker group within one attempt: 0 at the attempt's start, one more
after each hot recovery (set for the replacement by the agent, and by the worker wrapper for
the survivors). Process groups of generation g >= 1 live under their own store prefix."""
ENV_SNAPSHOT = "RESILIENT_SNAPSHOT"
"""In-memory snapshots for in-place rollback: "1"/"on" turns them on, or a JSON object of
SnapshotConfig fields, e.g. '{"enabled": true, "every_steps": 8}'."""
ENV_NUMERIC = "RESILIENT_NUMERIC"
"""Numerical-fault options: a JSON object of NumericConfig fields, e.g.
'{"policy": "skip", "spike_factor": 3}' (resilient/numeric/config.py)."""

ENV_UNTESTED_TORCH = "RESILIENT_UNTESTED_TORCH"
"""Set to "1" to run with a torch release outside the tested range (resilient/_torch_check.py):
a warning instead of the error. The private names resilient uses are still checked at import.
Set by hand, never by `resilient run`."""

# ---------------------------------------------------------------- torch elastic's
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
"""The rendezvous id, set by torch elastic for every worker; the run id of the event logs."""
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""How many times this node's agent restarted the group (differs between nodes after a
rejoin, which is why ENV_ATTEMPT exists)."""
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
""""True" when the workers should connect to the agent's TCPStore rather than host one."""
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where a worker writes its uncaught exception for the agent (resilient/runtime/errorfile.py)."""
TORCHELASTIC_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""Signals torch elastic's agent turns into SignalException and forwards to the workers; the
launcher adds the preemption signals."""
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to "1" by a multi-node `resilient run` (docs/internals.md#g-rdzv-shared-store)."""

DEFAULT_GRACE_S = 30.0
"""Preemption budget when neither --grace-period nor $RESILIENT_GRACE_S says otherwise."""
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
"""Signals that mean "save and leave" by default."""


HOT_WAIT_S = 30.0
"""How long a survivor of a hot recovery waits for the agent's next generation, and a rank
spared by a hot verdict for its main thread to meet the loss, before going cold."""


@dataclass(frozen=True)
class HotMode:
    """Hot recovery as this process's Runtime sees it: on or off, the generation it runs in,
    the attempt it belongs to. Read once from the environment (`from_env`, when a Runtime
    starts) and handed down to whatever needs it, never read again on the way."""

    enabled: bool = False
    """`resilient run --hot-recovery` set ENV_HOT."""
    generation: int = 0
    """0 at the attempt's start, one more after each hot recovery."""
    attempt: str = "0"
    """The attempt id that prefixes this attempt's hot keys in the launcher's store."""
    wait_s: float = HOT_WAIT_S

    @classmethod
    def from_env(cls) -> HotMode:
        return cls(
            enabled=os.environ.get(ENV_HOT, "") == "1",
            generation=int_env(ENV_GENERATION, 0),
            attempt=os.environ.get(ENV_ATTEMPT, "0"),
        )

    @property
    def rejoining(self) -> bool:
        """A generation after a hot recovery: its ranks re-form and restore from memory."""
        return self.enabled and self.generation >= 1

    @property
    def keys(self) -> HotKeys:
        return HotKeys(self.attempt)


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """ "SIGTERM,USR1" -> (SIGTERM, SIGUSR1); "" or "none" -> (). Raises ConfigError."""
    out: list[signal.Signals] = []
    for raw in text.split(","):
        name = raw.strip().upper()
        if not name or name == "NONE":
            continue
        name = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"{raw.strip()!r} is not a signal that can be handled; use names like "
                "SIGTERM,SIGUSR1"
            )
        if sig not in out:
            out.append(sig)
    return tuple(out)


def json_object_env(name: str) -> dict[str, Any]:
    """The JSON object in $`name` ({} when unset or blank). ConfigError naming the variable
    when it is not a JSON object."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"${name} is not a JSON object: {e}") from e
    if not isinstance(parsed, dict):
        raise ConfigError(f"${name} must be a JSON object, got {raw!r}")
    return parsed


def watchdog_setting(name: str, default: Any) -> Any:
    """Field `name` of $RESILIENT_WATCHDOG as the workers will read it; `default` when it is
    not set there or the variable does not parse (each worker then says why)."""
    try:
        return json_object_env(ENV_WATCHDOG).get(name, default)
    except ConfigError:
        return default


def hosted_store() -> tuple[str, int] | None:
    """(host, port) of the store in $RESILIENT_STORE (ENV_STORE); None when it is not set."""
    value = os.environ.get(ENV_STORE, "")
    if not value:
        return None
    host, port = value.rsplit(":", 1)
    return host, int(port)


def int_env(name: str, default: int) -> int:
    """The integer in $`name` (`default` when unset or empty). ConfigError naming the variable
    when it is not an integer."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from e


def untested_torch_allowed() -> bool:
    """$RESILIENT_UNTESTED_TORCH is "1": an untested torch release warns instead of failing."""
    return os.environ.get(ENV_UNTESTED_TORCH, "") == "1"
