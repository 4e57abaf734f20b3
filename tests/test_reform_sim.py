"""Hot recovery at 16,384 ranks, simulated: buddy placement, and the store traffic and time of
re-forming the groups under a new generation prefix after one process is lost.

No processes: 2,048 simulated hosts of 8 ranks. The store is modelled as one server that
handles requests one at a time, `OP_S` seconds each (a TCPStore round trip on this machine's
loopback measured 7-21 us for check/add under load 13-16; 10 us is used). What the model
counts is what the design in docs/hot-recovery.md sends: every survivor announces itself for
generation g+1 (one add), waits for the generation to be complete (one blocking wait, released
by one set), and the training group's bootstrap exchanges one id through the store (NCCL: one
set, N-1 gets). gloo's full-mesh rendezvous, an eager gloo group's, sends N(N-1) gets: the
simulation shows why the side groups cannot be formed eagerly at this size, and what they
cost now that they connect lazily (groups/_torch_compat.py, lazy_gloo_connections).
"""

from __future__ import annotations

import numpy as np

from resilient.memory.placement import buddies, unrecoverable

HOSTS, PER_HOST = 2_048, 8
N = HOSTS * PER_HOST
OP_S = 10e-6


def _hosts() -> list[str]:
    return [f"node{r // PER_HOST:04d}" for r in range(N)]


def test_buddies_at_16384_ranks_survive_any_one_host_lost() -> None:
    b = buddies(_hosts())
    assert sorted(b.tolist()) == list(range(N))  # a permutation: one replica per rank
    host = np.arange(N) // PER_HOST
    assert (host[b] != host).all()  # always on another host
    assert (b % PER_HOST == np.arange(N) % PER_HOST).all()  # the same local rank there
    for lost_host in (0, 777, HOSTS - 1):  # any one host: all of its ranks recoverable
        lost = range(lost_host * PER_HOST, (lost_host + 1) * PER_HOST)
        assert unrecoverable(b, lost) == []
    # two neighbouring hosts: the first one's replicas died with the second: cold path
    lost = range(5 * PER_HOST, 7 * PER_HOST)
    assert unrecoverable(b, lost) == list(range(5 * PER_HOST, 6 * PER_HOST))
    # two hosts apart: still hot
    assert unrecoverable(b, [*range(0, PER_HOST), *range(2 * PER_HOST, 3 * PER_HOST)]) == []


def test_buddies_on_one_host_and_on_uneven_hosts() -> None:
    b = buddies(["a"] * 4)
    assert b.tolist() == [1, 2, 3, 0]
    assert unrecoverable(b, [2]) == [] and unrecoverable(b, [1, 2]) == [1]
    b = buddies(["a", "a", "a", "b"])  # uneven: every replica still on the other host
    host = np.array([0, 0, 0, 1])
    assert (host[b] != host).all()


def _serve(arrivals: np.ndarray) -> np.ndarray:
    """Completion times of requests arriving at `arrivals` at one serial server."""
    done = np.empty_like(arrivals)
    t = 0.0
    for i, a in enumerate(np.sort(arrivals)):
        t = max(t, a) + OP_S
        done[i] = t
    return done


def test_reforming_16384_ranks_under_a_new_generation_costs_well_under_a_second() -> None:
    """One process lost, its replacement joins, every rank enters generation g+1. Survivors
    notice at different moments (the verdict is polled each heartbeat interval, 1 s): their
    announcements arrive spread over that second, then the bootstrap follows."""
    rng = np.random.default_rng(0)
    notice = rng.uniform(0.0, 1.0, N)  # when each survivor read the verdict
    joined = _serve(notice)  # one add each
    complete = joined.max() + OP_S  # the last joiner sets gen/<g+1>/ready
    released = complete + OP_S * np.arange(1, N + 1)  # N blocked waits answered
    ops = N + 1 + N
    # the training group's bootstrap under prefix gen_<g+1>: one id set, N-1 gets
    boot = _serve(np.concatenate([[released[0]], released[1:]]))
    ops += N
    t_store = boot.max() - notice.max()
    print(f"{N} ranks: {ops} store ops, store time after the last notice {t_store:.3f} s")
    assert ops == 3 * N + 1
    assert t_store < 1.0  # about 3N x 10 us = 0.5 s of serialised store work
    # gloo's eager full mesh (dist.new_group(backend="gloo") by default), per group
    full_mesh_ops = N + N * (N - 1)
    full_mesh_s = full_mesh_ops * OP_S
    print(f"a gloo side group, full mesh: {full_mesh_ops:.3g} ops, {full_mesh_s / 60:.0f} min")
    assert full_mesh_s > 30 * 60  # 45 min: a side group must not be formed eagerly at scale


def test_lazily_connected_side_groups_at_16384_ranks_cost_seconds() -> None:
    """Our side groups connect a pair of ranks at its first collective between them. What a
    group then sends through the store: each rank's address at creation (one set), and one
    get per pair that ever connects. Measured at 8 and 16 ranks (tests/test_torch_compat.py,
    docs/hot-recovery.md): a ring all-reduce or all-gather connects each rank to its
    neighbours, a barrier to log2(N) ranks more. The replica group connects buddies only."""
    log_n = int(np.log2(N))
    control_ops = N + N * (1 + log_n)  # all-reduces, all-gathers, barriers
    replica_ops = N + N  # send/recv with the buddy
    full_mesh_ops = N + N * (N - 1)
    print(
        f"lazy side groups at {N} ranks: control {control_ops:.3g} ops "
        f"({control_ops * OP_S:.1f} s), replica {replica_ops:.3g} ops "
        f"({replica_ops * OP_S:.2f} s); eager {full_mesh_ops:.3g} ops each"
    )
    assert control_ops * OP_S < 5.0  # seconds of store work, spread over the first collectives
    assert full_mesh_ops / control_ops > 900  # three orders of magnitude fewer
