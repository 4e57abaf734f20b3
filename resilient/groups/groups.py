"""Process groups from torchrun's environment: the training group plus two gloo side groups.

- training group: gloo on CPU, "cpu:gloo,cuda:nccl" on GPU (async save needs a CPU backend).
- control group (gloo): agreement traffic (save decisions, later heartbeats and OOM votes).
- checkpoint group (gloo): DCP's collectives, which run from a background thread during async
  saves; sharing the training group there deadlocked (docs/internals.md#g-async-save-group).

Each restart attempt gets its own PrefixStore namespace on the agent's store: reusing the
store's keys across restarts broke gloo's connectFullMesh
(docs/internals.md#g-per-attempt-store). The attempt is $RESILIENT_ATTEMPT when
`resilient run` set it (one id per rendezvous round, the same on every node), else
TORCHELASTIC_RESTART_COUNT (which differs between nodes once one has rejoined). A hot
recovery's generation g >= 1 (RESILIENT_GENERATION, hot/recovery.py) adds `/gen_<g>`: the
survivors and the replacement form fresh groups, and heartbeats and verdicts start clean.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient import storekeys
from resilient.envvars import (
    ENV_ATTEMPT,
    ENV_RUN_ID,
    TORCHELASTIC_RESTART_COUNT,
    TORCHELASTIC_RUN_ID,
    TORCHELASTIC_USE_AGENT_STORE,
    hosted_store,
    int_env,
)
from resilient.errors import ConfigError
from resilient.groups._torch_compat import lazy_gloo_connections

__all__ = [
    "ENV_ATTEMPT",
    "DistContext",
    "abandon_distributed",
    "connect_pairs",
    "init_distributed",
    "left_generations_behind",
    "shutdown_distributed",
]


@dataclass(frozen=True, slots=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    restart: int
    run_id: str
    host: str
    backend: str | None
    control_group: Any = None
    checkpoint_group: Any = None
    store: Any = None
    """The launcher's store under this attempt's prefix (heartbeats, verdicts)."""
    base_store: Any = None
    """The launcher's store without prefix: what must outlive a restart attempt."""

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def env_identity() -> tuple[int, int, str]:
    """(rank, restart, run id) as the launcher's environment gives them: what names this
    process's log before its process group exists (0, 0, "local" without a launcher)."""
    restart = int_env(TORCHELASTIC_RESTART_COUNT, 0)
    run_id = os.environ.get(TORCHELASTIC_RUN_ID) or os.environ.get(ENV_RUN_ID) or "local"
    return int_env("RANK", 0), restart, run_id


def init_distributed(
    *,
    backend: str | None = None,
    timeout_s: float = 1800.0,
    side_timeout_s: float = 300.0,
    store: Any = None,
    before_group: Callable[[Any, int, int], None] | None = None,
    generation: int = 0,
    connect_side: bool = False,
) -> DistContext:
    """Join the group torchrun describes in the environment; a single process without it.

    `store`: this process's existing connection to the launcher's store (a hot re-run keeps
    it), instead of a new one. `before_group(store, rank, world)` runs before the process
    group forms (the hot roll call). `generation`: a hot recovery's generation, whose groups
    live under their own store prefix. `connect_side`: connect the side groups' pairs now
    (`connect_pairs`; hot recovery). Raises ConfigError when the environment is incomplete.
    Waits up to `timeout_s` for peers.
    """
    _, restart, run_id = env_identity()
    host = socket.gethostname()
    if "RANK" not in os.environ:
        return DistContext(
            rank=0,
            world_size=1,
            local_rank=0,
            restart=restart,
            run_id=run_id,
            host=host,
            backend=None,
        )
    rank, world = int_env("RANK", 0), int_env("WORLD_SIZE", 1)
    local_rank = int_env("LOCAL_RANK", 0)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"RANK is set but {', '.join(missing)} is not: launch with torchrun "
            "or `resilient run`, or set the full torch.distributed environment"
        )
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    agent_store = os.environ.get(TORCHELASTIC_USE_AGENT_STORE, "").lower() == "true"
    user_group = dist.is_initialized()
    if store is None:
        # when the user made the group, this is our own client connection to the launcher's store
        hosted = hosted_store()  # the agent's, on several nodes (envvars.py)
        addr, port = hosted or (os.environ["MASTER_ADDR"], int_env("MASTER_PORT", 0))
        store = dist.TCPStore(
            addr,
            port,
            world_size=world,
            is_master=(rank == 0 and not agent_store and not user_group and hosted is None),
            timeout=timeout,
            wait_for_workers=False,
        )
    if before_group is not None:
        before_group(store, rank, world)
    attempt = os.environ.get(ENV_ATTEMPT) or str(restart)
    prefixed = dist.PrefixStore(storekeys.worker_prefix(attempt, generation), store)
    if user_group:  # use it, add our side groups
        backend = str(dist.get_backend())
    else:
        dist.init_process_group(
            backend, store=prefixed, rank=rank, world_size=world, timeout=timeout
        )
    side = timedelta(seconds=side_timeout_s)
    with lazy_gloo_connections():  # pairs connect at first use: O(N log N), not N(N-1)
        control = dist.new_group(backend="gloo", timeout=side)
        ckpt = dist.new_group(backend="gloo", timeout=side)
    if connect_side:
        for group in (control, ckpt):
            connect_pairs(group, world)
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        restart=restart,
        run_id=run_id,
        host=host,
        backend=backend,
        control_group=control,
        checkpoint_group=ckpt,
        store=prefixed,
        base_store=store,
    )


def connect_pairs(group: Any, world: int) -> None:
    """Run one collective of each kind the runtime runs on `group` (a side group of the
    whole world, made with lazy connections), so that every pair they use connects now,
    while every rank is alive. gloo's algorithms use the same pairs each time (a ring for
    all-reduce and all-gather, rank 0 with each rank for gather, scatter, broadcast from
    rank 0 and the monitored barrier). Under hot recovery this keeps each later wait on a
    peer a wait on an open connection: the kernel closes a dead peer's end, and a survivor
    can cut one to a survivor (hang/departed.py). A pair that never connected offers
    neither: its wait for the connection lasts the group's timeout (docs/hot-recovery.md)."""
    one, rank = torch.zeros(1), dist.get_rank()
    dist.all_reduce(one, group=group)
    dist.all_gather([torch.zeros(1) for _ in range(world)], one, group=group)
    dist.broadcast(one, src=0, group=group)
    dist.gather(one, [torch.zeros(1) for _ in range(world)] if rank == 0 else None, group=group)
    dist.scatter(one, [torch.zeros(1) for _ in range(world)] if rank == 0 else None, group=group)
    dist.barrier(group=group)


_LEFT_BEHIND: list[Any] = []
"""The side groups of the generations this process left (hot recovery), never released."""


def abandon_distributed(ctx: DistContext, *also: Any) -> None:
    """Leave the process groups of a generation that lost a peer: no barrier (the peer is
    gone), just destroy what this process holds. Its side groups (and `also`: the replica
    group) stay referenced for the process's life, as torch's DTensor caches keep a mesh's:
    a gloo group's destructor joins its worker threads, and one of them may still wait in a
    collective of the lost generation that nothing ends. Run by the garbage collection that
    follows a survivor's unwinding, that join hung 4 of 15 HSDP recoveries
    (docs/hot-recovery.md). The cost: a few sockets and threads per recovery, at most
    `--hot-max` per attempt. The interpreter's teardown would free them at the end, so such
    a process ends past it (resilient/worker.py, groups/exits.py: exit_past_teardown)."""
    _LEFT_BEHIND.append((ctx.control_group, ctx.checkpoint_group, *also))
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def left_generations_behind() -> bool:
    """This process left a generation's process groups behind (a hot recovery's survivor)."""
    return bool(_LEFT_BEHIND)


def shutdown_distributed(ctx: DistContext) -> None:
    """Barrier, then destroy: destroy alone aborted now and then
    (docs/internals.md#g-destroy-abort)."""
    if ctx.distributed and dist.is_initialized():
        dist.barrier(group=ctx.control_group)
        dist.destroy_process_group()
