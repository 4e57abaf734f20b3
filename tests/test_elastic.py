"""Elastic world size: resume on fewer or more ranks with the global batch and the data position
kept (no sample skipped or seen twice), and two real hosts (network namespaces) where one dies
and comes back."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SUPERVISED_WORKER,
    Launcher,
    kill_tree,
    last_by_step,
    records,
    run_cmd,
    run_events,
    spawn,
    wait_for,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from chaos.netns import Hosts, netns_unavailable
from recipes.common.data import build_dataset
from resilient.data.batches import ResumableBatches
from resilient.data.position import DataPosition
from resilient.exitcodes import ExitCode
from resilient.mesh import MeshLayout

SEED = 0


def _dataset() -> Any:
    return build_dataset(block_size=16, num_chars=40_000, seed=SEED)[0]  # as the worker's


def _expected_order(n: int, epoch: int = 0) -> list[int]:
    """The epoch's global sample order under DistributedSampler(shuffle=True, seed=SEED)."""
    g = torch.Generator().manual_seed(SEED + epoch)
    return torch.randperm(n, generator=g).tolist()


def _rank_batches(ds: Any, world: int, batch: int) -> list[ResumableBatches]:
    out = []
    for rank in range(world):
        sampler = StatefulDistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True
        )
        loader = StatefulDataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True)
        out.append(ResumableBatches(loader))
    return out


# ---------------------------------------------------------------------- units


@pytest.mark.parametrize(("w_old", "w_new", "batch"), [(2, 1, 4), (1, 4, 4), (4, 2, 3)])
def test_global_position_moves_to_a_new_world_exactly(w_old: int, w_new: int, batch: int) -> None:
    """W ranks take k batches each, the position moves to W' ranks: together they continue
    with exactly the samples the epoch's order has next, none twice."""
    ds = _dataset()
    order = _expected_order(len(ds))
    old = _rank_batches(ds, w_old, batch)
    seen: list[int] = []
    for _ in range(3):
        for b in old:
            seen += next(b)[0].tolist()
    pos = {b.global_position() for b in old}
    assert pos == {(0, 3 * batch * w_old)}  # every rank computes the same
    assert sorted(seen) == sorted(order[: 3 * batch * w_old])
    new = _rank_batches(ds, w_new, batch)
    epoch, consumed = pos.pop()
    for b in new:
        b.seek(epoch, consumed)
    more: list[int] = []
    for _ in range(2):
        for b in new:
            more += next(b)[0].tolist()
    assert sorted(more) == sorted(order[consumed : consumed + 2 * batch * w_new])
    assert not set(more) & set(seen)
    assert {b.global_position() for b in new} == {(0, consumed + 2 * batch * w_new)}


def test_same_world_state_round_trip_and_a_save_right_after_a_reshard() -> None:
    ds = _dataset()
    (b,) = _rank_batches(ds, 1, 4)
    for _ in range(2):
        next(b)
    (c,) = _rank_batches(ds, 1, 4)
    c.load_state_dict(b.state_dict())
    assert next(c)[0].tolist() == next(b)[0].tolist()  # the loader's own exact state
    (d,) = _rank_batches(ds, 1, 4)
    d.seek(0, 8)
    state = d.state_dict()  # no batch drawn since the reshard: no loader state yet
    assert state["loader"] is None and state["start"] == 8
    (e,) = _rank_batches(ds, 1, 4)
    e.load_state_dict(state)
    assert next(e)[0].tolist() == _expected_order(len(ds))[8:12]


def _same(a: Any, b: Any) -> bool:
    """Equal nested state (dicts, lists, tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("shuffled_by_generator", [False, True])
def test_state_right_after_a_load_is_the_loaded_state(shuffled_by_generator: bool) -> None:
    """A snapshot or save taken after a resume but before its first batch (the snapshot at
    the top of `steps()`) must describe the loaded position, not an epoch's start: a rollback
    to it once restarted the epoch (chaos soak 2026, run 0176: a hot resume, then an
    exception in its first step)."""
    ds = _dataset()

    def make() -> ResumableBatches:
        if shuffled_by_generator:
            gen = torch.Generator().manual_seed(SEED)
            return ResumableBatches(
                StatefulDataLoader(ds, batch_size=4, shuffle=True, generator=gen)
            )
        return _rank_batches(ds, 1, 4)[0]

    b = make()
    for _ in range(3):
        next(b)
    state = b.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    again = resumed.state_dict()  # no batch drawn since the load
    assert _same(again, state)
    rolled_back = make()
    rolled_back.load_state_dict(again)
    expected = [next(b)[0].tolist() for _ in range(2)]
    assert [next(rolled_back)[0].tolist() for _ in range(2)] == expected
    assert [next(resumed)[0].tolist() for _ in range(2)] == expected
    assert not _same(resumed.state_dict()["loader"], state["loader"])  # it moved on


def test_seek_refuses_what_cannot_be_exact() -> None:
    ds = _dataset()
    two = _rank_batches(ds, 2, 4)
    with pytest.raises(ValueError, match="do not split evenly"):
        two[0].seek(0, 7)
    plain = ResumableBatches(StatefulDataLoader(ds, batch_size=4))
    assert plain.global_position() is None
    with pytest.raises(ValueError, match="DistributedSampler"):
        plain.seek(0, 8)


def test_data_position_keeps_the_global_batch_through_accumulation() -> None:
    ds = _dataset()
    (b,) = _rank_batches(ds, 1, 4)
    pos = DataPosition(b, layout=MeshLayout.flat(1), rank=0, global_batch_size=None)
    assert (pos.global_batch, pos.grad_accum) == (4, 1)
    pos.load_state_dict({"world_size": 2, "global_batch": 8, "epoch": 0, "consumed": 16})
    pos.apply()
    assert (pos.global_batch, pos.grad_accum) == (8, 2)
    assert b.global_position() == (0, 16)


def test_a_global_batch_the_loaders_batch_cannot_split_goes_on_under_either_policy() -> None:
    """Issue 49: 8 saved on 2 ranks of 4, resumed on 1 rank whose loader yields 3: "exact"
    keeps 8 in micro-batches of 2 (4 a step, the samples an unchanged run takes), "follow"
    keeps 3 a micro-batch and trains on 6. Neither refuses."""
    ds = _dataset()
    saved = {"world_size": 2, "global_batch": 8, "epoch": 0, "consumed": 16, "micro": 4}
    (c,) = _rank_batches(ds, 1, 3)
    exact = DataPosition(c, layout=MeshLayout.flat(1), rank=0, global_batch_size=None)
    exact.load_state_dict(saved)
    exact.apply()
    assert (exact.global_batch, exact.effective_batch, exact.micro) == (8, 8, 2)
    assert exact.grad_accum == 4 and c.batch_size == 2 and c.loader.batch_size == 3
    order = _expected_order(len(ds))
    ids = [int(i) for _ in range(exact.grad_accum) for i in next(c)[0]]
    assert ids == order[16:24]  # the step's 8 samples, exactly an unchanged run's
    assert c.global_position() == (0, 24)
    (f,) = _rank_batches(ds, 1, 3)
    follow = DataPosition(f, MeshLayout.flat(1), 0, None, "follow")
    follow.load_state_dict(saved)
    follow.apply()
    assert (follow.global_batch, follow.effective_batch, follow.micro) == (8, 6, 3)
    assert follow.grad_accum == 2 and f.batch_size == 3
    assert [int(i) for _ in range(2) for i in next(f)[0]] == order[16:22]
    # at start, an explicit global batch the loader's batch cannot split: kept exactly
    (e,) = _rank_batches(ds, 1, 3)
    pos = DataPosition(e, layout=MeshLayout.flat(1), rank=0, global_batch_size=10)
    assert (pos.micro, pos.grad_accum, pos.effective_batch) == (2, 5, 10)


def test_a_loop_that_ignores_grad_accum_is_told_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import resilient.data.position as position

    said: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def info(self, event: str, **kw: Any) -> None:
            pass

        def warning(self, event: str, **kw: Any) -> None:
            said.append((event, kw))

    monkeypatch.setattr(position, "get_logger", lambda: Log())
    (c,) = _rank_batches(_dataset(), 1, 3)
    pos = DataPosition(c, layout=MeshLayout.flat(1), rank=0, global_batch_size=8)
    assert (pos.micro, pos.grad_accum) == (2, 4)
    said.clear()
    for step in range(3):
        for _ in range(pos.grad_accum if step == 0 else 1):
            next(c)
        pos.step_end(step)
    assert [e for e, _ in said] == ["data.accum_ignored"]  # step 1, once
    assert said[0][1]["step"] == 1 and said[0][1]["trained_on"] == 2
    assert "range(rt.grad_accum)" in said[0][1]["reason"]


def test_split_batch_under_each_policy() -> None:
    from resilient.data.policy import split_batch

    assert split_batch(24, 8, 3, "exact").how == "kept"
    s = split_batch(24, 8, 2, "exact")
    assert (s.how, s.micro, s.accum, s.effective) == ("exact", 6, 2, 24)
    s = split_batch(24, 8, 2, "follow")
    assert (s.how, s.micro, s.accum, s.effective) == ("follows", 8, 1, 16)
    s = split_batch(32, 8, 3, "exact")  # 32 has no equal shares on 3 ranks
    assert (s.how, s.effective) == ("follows", 24) and "equal shares" in s.reason
    s = split_batch(16, 8, 4, "exact")  # grown: smaller micro-batches keep it
    assert (s.how, s.micro, s.accum, s.effective) == ("exact", 4, 1, 16)
    assert split_batch(16, 8, 4, "follow").effective == 32  # follows up, never 0 steps
    s = split_batch(16, 4, 2, "follow")  # divisible: accumulation keeps it under both
    assert (s.how, s.accum, s.effective) == ("kept", 2, 16)
    with pytest.raises(ValueError, match="batch policy"):
        split_batch(8, 4, 2, "fast")


# ---------------------------------------------------------------------- end to end


def _check_samples(rec: Path, steps: int, global_batch: int) -> list[tuple[int, int]]:
    """Each step consumed exactly the next global batch of the epoch order, whatever world
    size ran it; returns (world size, micro-batches) per step."""
    order = _expected_order(len(_dataset()))
    final = last_by_step(records(rec))
    assert sorted(final) == list(range(steps))
    shape = []
    for step, recs in final.items():
        ids = sorted(i for r in recs for i in r["ids"])
        assert ids == sorted(order[step * global_batch : (step + 1) * global_batch]), step
        assert len({r["world"] for r in recs}) == 1 and len(recs) == recs[0]["world"]
        shape.append((recs[0]["world"], recs[0]["accum"]))
    return shape


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_world_shrinks_and_grows_between_runs(tmp_path: Path, launcher: Launcher) -> None:
    """2 ranks to step 4, 1 rank to step 8 (two micro-batches per step), 2 ranks to step 12."""
    base = [
        f"--run-dir={tmp_path / 'run'}",
        f"--checkpoint-url={tmp_path / 'ckpt'}",
        str(SUPERVISED_WORKER),
        f"--record={tmp_path / 'rec'}",
        "--steps=12",
        "--save-every=100",
        "--batch=4",
    ]
    for nproc, stop in [(2, 4), (1, 8), (2, None)]:
        code, _, err = launcher.run(
            run_cmd(f"--nproc-per-node={nproc}", *base, *([f"--stop-at={stop}"] if stop else [])),
            timeout=120,
        )
        assert code == 0, err[-3000:]
    shape = _check_samples(tmp_path / "rec", 12, global_batch=8)
    assert shape == [(2, 1)] * 4 + [(1, 2)] * 4 + [(2, 1)] * 4
    resharded = run_events(tmp_path / "run", "data.reshard")
    assert {(e["saved_world_size"], e["world_size"], e["consumed"]) for e in resharded} == {
        (2, 1, 32),
        (1, 2, 64),
    }


# ---------------------------------------------------------------------- two hosts


def _stop_all(procs: list[subprocess.Popen[bytes]], hosts: Hosts | None = None) -> None:
    """Kill the agents (and, with `hosts`, every process of both hosts), reap, and kill
    whatever of their trees is left."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    if hosts is not None:
        hosts.down()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    for p in procs:
        kill_tree(p.pid, groups=(p.pid,))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_still_leaving_when_the_rendezvous_host_has_gone_exits_preempted(
    tmp_path: Path,
) -> None:
    """At the end of a coordinated stop the node hosting the rendezvous store may commit and
    exit first, and take the store with it while another node's workers are still leaving.
    That node's agent then meets a lost store: it must exit PREEMPTED, as its workers did,
    not 'rendezvous failed' (a CI run met this race: exit 1). Host B's worker sleeps 8 s at
    its exit, so host A's agent is always gone first."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    procs: list[subprocess.Popen[bytes]] = []
    rec, ckpt = tmp_path / "rec", tmp_path / "ckpt"

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()[-3000:]

    with Hosts() as hosts:
        try:
            for i in (1, 0):
                name = "AB"[i]
                cmd = [
                    *hosts.exec_prefix(i),
                    *run_cmd(
                        "--nnodes=2",
                        "--nproc-per-node=1",
                        "--rdzv-backend=c10d",
                        f"--rdzv-endpoint={hosts.addr[0]}:29400",
                        "--rdzv-id=leaving",
                        f"--rdzv-conf=is_host={int(i == 0)},join_timeout=60",
                        f"--local-addr={hosts.addr[i]}",
                        f"--run-dir={tmp_path / ('run' + name)}",
                        f"--checkpoint-url={ckpt}",
                        str(SUPERVISED_WORKER),
                        f"--record={rec}",
                        "--steps=400",
                        "--save-every=4",
                        "--sleep=0.2",
                        "--linger=1:8",
                    ),
                ]  # fmt: skip
                with (tmp_path / f"{name}.log").open("wb") as out:
                    procs.append(spawn(cmd, stdout=out, stderr=subprocess.STDOUT))
            b, a = procs
            wait_for(
                lambda: len([r for r in records(rec) if r["rank"] == 0]) >= 3,
                timeout=120,
                what="three steps on two hosts",
            )
            a.send_signal(signal.SIGTERM)
            assert a.wait(timeout=60) == ExitCode.PREEMPTED, log("A")
            assert b.poll() is None  # its worker is still leaving (--linger)
            assert b.wait(timeout=60) == ExitCode.PREEMPTED, log("B")
        finally:
            _stop_all(procs)
    (gone,) = run_events(tmp_path / "runB", "preempt.rendezvous_gone")
    assert gone["local_ranks"] == [0]
    stops = run_events(tmp_path / "runB", "preempt.exit")
    assert stops and stops[-1]["committed"] == stops[-1]["step"]  # B's rank left committed


@pytest.mark.slow
@pytest.mark.extended  # 50 s: make soak; CI's two-host runs are the exclusion and leaving tests
@pytest.mark.timeout(420)
def test_two_hosts_one_drops_out_twice_the_other_continues_and_it_rejoins(tmp_path: Path) -> None:
    """Host A (rendezvous host) and host B, one rank each, --nnodes 1:2, until SIGTERM to A.

    1. B's link is cut: A's watchdog names the silent rank and A restarts alone from the last
       checkpoint (resharded, two micro-batches per step). The link comes back: B's agent,
       still waiting in the rendezvous, is admitted; A's agent stops its worker with a save
       (zero steps lost) and both continue.
    2. B is killed (kill -9 of all its processes): the same, and a new agent on B rejoins.
    Every step consumes exactly the global batch an undisturbed run would.
    """
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    hosts = Hosts()
    procs: list[subprocess.Popen[bytes]] = []
    rec, ckpt = tmp_path / "rec", tmp_path / "ckpt"

    def agent(i: int, log: str) -> subprocess.Popen[bytes]:
        name = "AB"[i]
        cmd = [
            *hosts.exec_prefix(i),
            *run_cmd(
                "--nnodes=1:2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={hosts.addr[0]}:29400",
                "--rdzv-id=two-hosts",
                f"--rdzv-conf=is_host={int(i == 0)},last_call_timeout=1,keep_alive_interval=1,"
                "keep_alive_max_attempt=3,join_timeout=120",
                f"--local-addr={hosts.addr[i]}",
                f"--run-dir={tmp_path / ('run' + name)}",
                f"--checkpoint-url={ckpt}",
                "--restart-backoff=0.2",
                "--restart-jitter=0",
                str(SUPERVISED_WORKER),
                f"--record={rec}",
                "--steps=400",  # more than the test needs: it ends the run with SIGTERM
                "--save-every=4",
                "--sleep=0.3",
                '--watchdog={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, '
                '"timeout_s": 30, "startup_timeout_s": 60}',
            ),
        ]  # fmt: skip
        with (tmp_path / log).open("wb") as out:
            p = spawn(cmd, stdout=out, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def at(world: int) -> list[int]:
        return [r["step"] for r in records(rec) if r["world"] == world and r["rank"] == 0]

    def committed() -> int:
        done = [int(d.name[5:]) for d in ckpt.glob("step_*") if (d / "manifest.json").exists()]
        return max(done, default=-1)

    try:
        hosts.up()
        agent(1, "B.log")  # waits for A's rendezvous store, so both join the first round
        wait_for(
            lambda: run_events(tmp_path / "runB", "supervisor.start"),
            timeout=60,
            what="B's agent at its rendezvous",
        )
        a = agent(0, "A.log")
        # each two-host phase outlives a checkpoint, so no replay hides it in the step record
        wait_for(
            lambda: len(at(2)) >= 6 and committed() >= 4,
            timeout=150,
            what="a checkpoint on two hosts",
        )
        n2 = len(at(2))
        hosts.link(False)
        wait_for(lambda: len(at(1)) >= 4, timeout=120, what="four steps on host A alone (link cut)")
        hosts.link(True)
        wait_for(lambda: len(at(2)) > n2, timeout=120, what="B's return after its link came back")
        back = at(2)[n2]  # the step the two hosts went on from (committed by the stop)
        wait_for(
            lambda: committed() >= back + 4 and max(at(2)) > committed(),
            timeout=120,
            what="a checkpoint after B's return",
        )
        n1 = len(at(1))
        hosts.kill(1)
        wait_for(
            lambda: len(at(1)) >= n1 + 4, timeout=120, what="four steps on host A alone (B killed)"
        )
        n2 = len(at(2))
        b2 = agent(1, "B2.log")
        wait_for(lambda: len(at(2)) > n2, timeout=120, what="the new agent on B admitted")
        back = at(2)[n2]
        wait_for(
            lambda: committed() >= back + 4,
            timeout=120,
            what="a checkpoint after the second return",
        )
        a.send_signal(signal.SIGTERM)  # the end: both hosts stop at one step with a save
        assert a.wait(timeout=120) == ExitCode.PREEMPTED, (tmp_path / "A.log").read_text()[-4000:]
        assert b2.wait(timeout=60) == ExitCode.PREEMPTED, (tmp_path / "B2.log").read_text()[-4000:]
    finally:
        _stop_all(procs, hosts)
    steps = committed()  # the stop's checkpoint: every step before it ran, none after
    assert steps == max(r["step"] for r in records(rec)) + 1
    shape = _check_samples(rec, steps, global_batch=8)
    worlds = [w for w, _ in shape]
    phases = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert phases == [2, 1, 2, 1, 2], worlds
    assert {acc for w, acc in shape if w == 1} == {2}  # the global batch kept by accumulation
    run_a = tmp_path / "runA"
    lost = run_events(run_a, "fault.detected")
    assert [e["kind"] for e in lost] == ["no_heartbeat", "no_heartbeat"]
    assert all(len(e["ranks"]) == 1 for e in lost)
    assert len(run_events(run_a, "restart.membership")) >= 2  # B admitted at a rendezvous, twice
    # each return of B stopped A's lone worker with a save at the step training went on from
    rejoined = [i for i in range(1, steps) if worlds[i - 1] == 1 and worlds[i] == 2]
    saved = {e["step"] for e in run_events(run_a, "preempt.exit") if e["committed"] == e["step"]}
    assert set(rejoined) <= saved, (rejoined, saved)
