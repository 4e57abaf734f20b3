"""Every torch elastic internal the supervisor uses, checked at import.

`resilient run` reuses torch elastic's agent loop and torchrun's own parser rather than forking
them. That needs names torch does not document as an API:

- `SimpleElasticAgent`'s extension points `_start_workers`, `_monitor_workers`,
  `_stop_workers` and `_shutdown`: `ElasticAgentBase` below is the only class that overrides
  them. It forwards each to a method of ours (`start_workers`, ...) whose default is torch's
  behaviour, so resilient/supervisor/agent.py overrides public names and calls `super()`.
- The agent's state `_pcontext` (the worker processes; read for their pids) and
  `_remaining_restarts` (set to 0 to stop restarting), as torch's own LocalElasticAgent uses
  them: `worker_pids()` and `remaining_restarts` below.
- For hot recovery (`--hot-recovery`), the process context of a script entrypoint,
  `SubprocessContext`, and what it holds per local rank (`subprocess_handlers`, `envs`,
  `args`, `stdouts`, `stderrs`, `entrypoint`, `_numa_options`, `_running_local_ranks`) with
  torch's own `get_subprocess_handler`: `replace_worker()` below starts one new process for
  one local rank and puts it where torch's monitor and shutdown look for that rank's worker.
  A warm spare (supervisor/spare.py) was started by us, so its handler is a
  `SubprocessHandler` whose fields (`proc`, `local_rank_id`, `_stdout`, `_stderr`) are set
  here rather than by its constructor, which would start a process.
- `torch.distributed.run`'s `get_args_parser`, `parse_min_max_nnodes` and `config_from_args`:
  torchrun's flags, environment defaults and LaunchConfig, unchanged.

A torch without one of them fails here, at import, with TorchCompatError naming the torch
version and the feature (resilient/_torch_check.py), not in the middle of a run.

Two differ inside the tested range, both from torch 2.13 on: `_shutdown` takes the workers'
time to stop (`timeout`), which the agent's run loop passes (before, `shutdown()` closes the
process context with it first: SHUTDOWN_TAKES_TIMEOUT), and torchrun has --shutdown-timeout
and no default --master-port (before, `get_args_parser()` makes its parser so).

Checked on torch 2.11.0, 2.12.0, 2.13.0, 2.14.1, 2.15.0 (the tested range): every name above
is there on each; which of the supervisor's and hot recovery's tests ran on which release:
docs/operating.md#torch-releases.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import signal
from dataclasses import fields
from typing import Any

from torch.distributed.argparse_util import env
from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.launcher.api import LaunchConfig

from resilient._torch_check import (
    require_attrs,
    require_import,
    require_params,
    require_self_attrs,
)

__all__ = ["ElasticAgentBase", "config_from_args", "get_args_parser", "parse_min_max_nnodes"]

_AGENT = "resilient run's supervised agent (resilient/supervisor/agent.py)"
_HOOKS = {
    "_start_workers": ("worker_group",),
    "_monitor_workers": ("worker_group",),
    "_stop_workers": ("worker_group",),
    "_shutdown": ("death_sig",),
}
require_attrs(LocalElasticAgent, _HOOKS, feature=_AGENT)
for _hook, _params in _HOOKS.items():
    require_params(getattr(LocalElasticAgent, _hook), _params, feature=_AGENT)
require_self_attrs(LocalElasticAgent, ("_pcontext", "_remaining_restarts"), feature=_AGENT)
# torch 2.13 added `timeout` to _shutdown (how long the workers get between `death_sig` and
# SIGKILL; a preemption's grace). Before, it closed the process context with PContext.close's
# default of 30 s: there `shutdown()` closes the context itself with the timeout first.
SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
if not SHUTDOWN_TAKES_TIMEOUT:
    require_params(PContext.close, ("death_sig", "timeout"), feature=_AGENT)
require_attrs(SimpleElasticAgent, ("get_worker_group",), feature=_AGENT)

_HOT = "hot recovery's replacement of one worker (resilient run --hot-recovery)"
require_self_attrs(
    SubprocessContext,
    (
        "subprocess_handlers",
        "envs",
        "args",
        "stdouts",
        "stderrs",
        "entrypoint",
        "_numa_options",
        "_running_local_ranks",
    ),
    feature=_HOT,
)
require_self_attrs(SubprocessHandler, ("proc", "local_rank_id", "_stdout", "_stderr"), feature=_HOT)
require_attrs(SubprocessHandler, ("close",), feature=_HOT)
get_subprocess_handler = require_import(
    "torch.distributed.elastic.multiprocessing.subprocess_handler",
    "get_subprocess_handler",
    feature=_HOT,
)

_PARSER = "resilient run's command line (torchrun's own flags)"
_torchrun_parser = require_import("torch.distributed.run", "get_args_parser", feature=_PARSER)
LAUNCH_HAS_SHUTDOWN_TIMEOUT = "shutdown_timeout" in {f.name for f in fields(LaunchConfig)}
"""torchrun has --shutdown-timeout and LaunchConfig its field from torch 2.13 (before, the
workers got PContext.close's 30 s): older, `get_args_parser` adds the flag itself."""


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's parser as torch 2.13 has it, on every tested torch: --shutdown-timeout, and
    no default --master-port."""
    parser = _torchrun_parser()
    if parser.get_default("master_port") is not None and "PET_MASTER_PORT" not in os.environ:
        # torch < 2.13 defaults it to 29500, so a port given cannot be told from none, which
        # the choice of a standalone rendezvous needs (config.py fills 29500 in later, as
        # torchrun 2.13 does)
        parser.set_defaults(master_port=None)
    if not LAUNCH_HAS_SHUTDOWN_TIMEOUT:
        parser.add_argument(
            "--shutdown-timeout",
            "--shutdown_timeout",
            action=env,  # torchrun's: PET_SHUTDOWN_TIMEOUT as the default, as its own flags
            type=int,
            default=None,
            help="Time in seconds the workers get between the stop signal and SIGKILL "
            "(default 30; never below --grace-period).",
        )
    return parser


parse_min_max_nnodes = require_import(
    "torch.distributed.run", "parse_min_max_nnodes", feature=_PARSER
)
config_from_args = require_import("torch.distributed.run", "config_from_args", feature=_PARSER)


class ElasticAgentBase(LocalElasticAgent):
    """LocalElasticAgent with its private extension points under our own names.

    Subclasses override `start_workers`, `monitor_workers`, `stop_workers` and `shutdown`
    (each defaults to torch's behaviour) and read the agent's state through `worker_pids()`,
    `remaining_restarts` and `max_restarts`.
    """

    def __init__(self, spec: Any, *, shutdown_timeout: int = 30, **kwargs: Any) -> None:
        if SHUTDOWN_TAKES_TIMEOUT:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(spec, **kwargs)
        self.shutdown_timeout_s = shutdown_timeout
        """The workers' time between the stop signal and SIGKILL when the agent's run ends
        (torch >= 2.13 passes it to `_shutdown` itself; older torch passes nothing)."""

    # torch's private hooks, called by its agent loop: forwarded to ours
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self.start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self.monitor_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self.stop_workers(worker_group)

    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, timeout: int | None = None
    ) -> None:
        self.shutdown(death_sig, self.shutdown_timeout_s if timeout is None else timeout)

    # ours, defaulting to torch's behaviour
    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start the group's processes; returns local rank -> pid."""
        return super()._start_workers(worker_group)

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """One look at the group's processes."""
        return super()._monitor_workers(worker_group)

    def stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the group before a restart (torch: SIGTERM, then SIGKILL after 30 s)."""
        super()._stop_workers(worker_group)

    def shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Signal the workers with `death_sig`, SIGKILL them after `timeout` s, free resources."""
        if SHUTDOWN_TAKES_TIMEOUT:
            super()._shutdown(death_sig, timeout)
            return
        if self._pcontext is not None:
            self._pcontext.close(death_sig, timeout)  # then torch's close finds them gone
        super()._shutdown(death_sig)

    # the agent's state
    def worker_pids(self) -> dict[int, int] | None:
        """Local rank -> pid of the running group; None before the first start."""
        pc = self._pcontext
        return None if pc is None else dict(pc.pids())

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """The environment the running group's `local_rank` was started with."""
        pc = self._pcontext
        if not isinstance(pc, SubprocessContext):
            raise RuntimeError(f"the workers run in a {type(pc).__name__}, not as subprocesses")
        return dict(pc.envs[local_rank])

    def replace_worker(
        self, local_rank: int, extra_env: dict[str, str], spare: Any = None
    ) -> tuple[int, bool]:
        """Start a new process for `local_rank` of the running group, in place of its exited
        one (reaped here): same entrypoint, arguments, environment plus `extra_env`, and log
        files (the old ones are kept with the old pid as suffix). A ready `spare`
        (supervisor/spare.py) becomes the process when the workers run under the worker
        wrapper. Returns (the new pid, whether the spare was used). Raises RuntimeError when
        the process context is not one of script entrypoints."""
        pc = self._pcontext
        if not isinstance(pc, SubprocessContext):
            raise RuntimeError(f"the workers run in a {type(pc).__name__}, not as subprocesses")
        old = pc.subprocess_handlers[local_rank]
        old.proc.wait()
        with contextlib.suppress(Exception):
            old.close()  # its log file handles
        env = {**pc.envs[local_rank], **extra_env}
        for path in (pc.stdouts[local_rank], pc.stderrs[local_rank]):
            if path and os.path.exists(path):
                os.replace(path, f"{path}.{old.proc.pid}")
        from resilient.supervisor.spare import spare_argv

        argv = spare_argv(pc.args[local_rank])
        if spare is not None and spare.ready and argv is not None:
            proc = spare.take(
                env={**os.environ, **env},
                argv=argv,
                stdout=pc.stdouts[local_rank] or None,
                stderr=pc.stderrs[local_rank] or None,
            )
            new = SubprocessHandler.__new__(SubprocessHandler)
            new._stdout = new._stderr = None  # the spare opened its log files itself
            new.local_rank_id = local_rank
            new.proc = proc
            used = True
        else:
            new = get_subprocess_handler(
                entrypoint=pc.entrypoint,
                args=pc.args[local_rank],
                env=env,
                stdout=pc.stdouts[local_rank],
                stderr=pc.stderrs[local_rank],
                local_rank_id=local_rank,
                numa_options=pc._numa_options,
            )
            used = False
        pc.subprocess_handlers[local_rank] = new
        pc.envs[local_rank] = env
        pc._running_local_ranks.add(local_rank)
        return int(new.proc.pid), used

    @property
    def max_restarts(self) -> int:
        return int(self.get_worker_group().spec.max_restarts)

    @property
    def remaining_restarts(self) -> int:
        return int(self._remaining_restarts)

    @remaining_restarts.setter
    def remaining_restarts(self, value: int) -> None:
        self._remaining_restarts = value
