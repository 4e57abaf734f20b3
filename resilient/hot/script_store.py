"""A fresh store for a hot generation's process group when the script makes that group itself.

`resilient run` gives each rendezvous round a fresh store, and a script's own
`init_process_group` (every framework makes one: Accelerate in TrainingArguments, Lightning
in its strategy) finds it at MASTER_ADDR:MASTER_PORT (docs/internals.md#g-per-attempt-store).
A hot recovery re-runs the script inside the same round: its `init_process_group` would read
the last generation's peer addresses from that store and fail ("Connection refused") or hang
in gloo's connectFullMesh. The groups that `resilient.init()` makes carry the generation in
their key prefix; a script's own group cannot. So before the script runs in generation g >= 1,
rank 0 hosts an empty store for it, publishes where in the round's store, and every rank points
MASTER_ADDR:MASTER_PORT there. The store lives in rank 0's process, as long as the generation:
if rank 0 is lost, the next generation gets a new one.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from resilient.envvars import ENV_ATTEMPT, hosted_store, int_env
from resilient.hot import carry
from resilient.storekeys import HotKeys

__all__ = ["point_at_generation_store", "script_group_formed_without_me"]

_SERVERS: list[Any] = []
"""The stores this process hosts for its generations (a reference keeps each one up)."""

_POINTED: dict[int, tuple[str, int]] = {}
"""generation -> the address of its script store, as this process was pointed at it."""

WAIT_S = 60.0
"""How long a rank waits for rank 0's store address before it leaves the variables as they
are (the script's group then fails to form, and the recovery goes cold)."""


def _round_store() -> Any:
    """This process's connection to the round's store: the survivor's carried one, or a new
    client (a replacement)."""
    held = carry.peek()
    if held is not None:
        return held.store
    from torch.distributed import TCPStore

    hosted = hosted_store()
    host, port = hosted or (os.environ["MASTER_ADDR"], int_env("MASTER_PORT", 0))
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=WAIT_S))


def point_at_generation_store(generation: int) -> None:
    """Before the script runs in hot generation `generation`: MASTER_ADDR:MASTER_PORT name a
    store that no earlier generation used (rank 0 hosts it). Nothing for generation 0."""
    if generation < 1 or "RANK" not in os.environ or ENV_ATTEMPT not in os.environ:
        return
    from torch.distributed import TCPStore

    keys = HotKeys(os.environ[ENV_ATTEMPT])
    key, store = keys.script_store(generation), _round_store()
    if int_env("RANK", 0) == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _SERVERS.append(server)
        addr = f"{host}:{server.port}"
        store.set(key, addr)
    else:
        try:
            store.wait([key], timedelta(seconds=WAIT_S))
        except Exception:  # rank 0 never came: the roll call names it and goes cold
            return
        addr = bytes(store.get(key)).decode()
    host, port = addr.rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
    _POINTED[generation] = (host, int(port))
    # a client of the store above, on one node and on several (where torch would otherwise
    # have worker rank 0 host one at MASTER_PORT, as in generation 0)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"


def script_group_formed_without_me(generation: int) -> bool:
    """In the roll call of hot generation `generation`: True when another rank made the
    script's own process group (its keys are in the generation's script store) while this
    rank's script went on without one. That rank waits in `init_process_group` for this one,
    which waits for it in the roll call: neither can come (a framework that keeps "the group
    is made" across the re-run; framework_state.py empties Accelerate's)."""
    import torch.distributed as dist

    where = _POINTED.get(generation)
    if where is None or dist.is_initialized():
        return False
    from torch.distributed import TCPStore

    # its host, rank 0, gone: the roll call names that itself. Asked with a plain socket
    # first, as a store client retries a refused connection (and logs each try) until its
    # timeout
    try:
        socket.create_connection(where, timeout=2).close()
    except OSError:
        return False
    try:  # a fresh store holds no key until a rank's init_process_group writes one
        client = TCPStore(where[0], where[1], is_master=False, timeout=timedelta(seconds=5))
        return int(client.num_keys()) > 0
    except (RuntimeError, dist.DistError):
        return False
