"""Buddy placement for replicated snapshots: which rank holds a copy of which rank's state.

A rank's buddy is the same local rank on the next host (hosts in the order their first rank
appears, wrapping around), so a lost host's state survives on the next one; on a single host,
the next local rank. The map is a permutation: every rank holds exactly one replica. Losing a
rank is recoverable hot when its buddy lives; a rank and its buddy lost together (two
neighbouring hosts, or a host of a two-host job) is not, and must take the cold path.
Pure logic (no store, no torch.distributed): the replication and the simulation in
tests/test_reform_sim.py use it alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["buddies", "unrecoverable"]


def buddies(hosts: Sequence[str]) -> np.ndarray:
    """`hosts[r]` is rank r's host; returns `b` with `b[r]` the rank holding r's replica."""
    order: dict[str, int] = {}
    for h in hosts:
        order.setdefault(h, len(order))
    host_idx = np.fromiter((order[h] for h in hosts), dtype=np.int64, count=len(hosts))
    n_hosts = len(order)
    members: list[list[int]] = [[] for _ in range(n_hosts)]
    for r, hi in enumerate(host_idx):
        members[int(hi)].append(r)
    out = np.empty(len(hosts), dtype=np.int64)
    for k, ranks in enumerate(members):
        if n_hosts == 1:  # one host: the next local rank (a process, not a host, may fail)
            for i, r in enumerate(ranks):
                out[r] = ranks[(i + 1) % len(ranks)]
            continue
        nxt = members[(k + 1) % n_hosts]
        for i, r in enumerate(ranks):
            out[r] = nxt[i % len(nxt)]
    return out


def unrecoverable(buddy: np.ndarray, lost: Iterable[int]) -> list[int]:
    """The lost ranks whose replica was lost with them (both copies gone): cold path."""
    gone = set(lost)
    return sorted(r for r in gone if int(buddy[r]) in gone)
