"""The pure rules behind hot recovery, hang verdicts and fault points, in milliseconds.

The multi-process tests (test_hot.py, test_hang.py, test_chaos.py) show the rules at work in
real runs; these pin each rule down on its own, case by case, with no process started.
"""

from __future__ import annotations

import pytest

from resilient import faultpoints, storekeys
from resilient.envvars import ENV_ATTEMPT, ENV_GENERATION, ENV_HOT, HOT_WAIT_S, HotMode
from resilient.exitcodes import ExitCode
from resilient.hang.config import WatchdogConfig
from resilient.hang.heartbeat import Detection, RankStatus
from resilient.hang.verdict import hot_eligible, judge, spares
from resilient.hot.reform import judge_roll_call
from resilient.hot.restore import plan_restore
from resilient.mesh import MeshLayout

pytestmark = pytest.mark.timeout(30)


def _survivor(steps: list[int], ward: int | None = None, ward_steps: list[int] | None = None,
              sharded: bool = False) -> dict[str, object]:  # fmt: skip
    return {
        "steps": steps,
        "survivor": True,
        "at": max(steps, default=0),
        "lost": None,
        "sharded": sharded,
        "ward": ward,
        "ward_steps": ward_steps or [],
        "every": 1,
    }


def _replacement(steps: list[int] | None = None) -> dict[str, object]:
    return {"steps": steps or [], "survivor": False, "at": None, "lost": None}


# ---------------------------------------------------------------- plan_restore
def test_a_ddp_replacement_takes_the_state_from_a_survivor_and_its_part_from_its_buddy() -> None:
    plan = plan_restore([_survivor([4, 8], ward=1, ward_steps=[4, 8]), _replacement()])
    assert plan.target == 8 and not plan.sharded
    assert plan.source == {1: 0} and plan.part_from == {1: 0}


def test_with_replicas_off_a_ddp_replacement_takes_its_part_from_the_store() -> None:
    plan = plan_restore([_survivor([4, 8]), _replacement([8])])
    assert plan.target == 8 and plan.source == {1: 0} and plan.part_from == {}


def test_the_newest_step_every_rank_holds_wins() -> None:
    every = [
        _survivor([4, 8], ward=1, ward_steps=[4, 8]),
        _replacement(),
        _survivor([8, 12], ward=0, ward_steps=[8, 12]),
    ]
    assert plan_restore(every).target == 8


def test_no_common_step_goes_cold_and_says_why() -> None:
    plan = plan_restore([_survivor([4]), _replacement([8])])
    assert plan.target is None
    assert plan.why_not == "no snapshot step every rank can restore"


def test_sharded_state_without_replicas_cannot_go_hot() -> None:
    plan = plan_restore([_survivor([4], sharded=True), _replacement()])
    assert plan.target is None and "replicas=0" in plan.why_not


def test_a_sharded_replacement_whose_buddy_was_lost_too_goes_cold() -> None:
    # rank 0 holds rank 1's replica; rank 2's buddy (rank 3) was lost with it
    every = [
        _survivor([4], ward=1, ward_steps=[4], sharded=True),
        _survivor([4], ward=0, ward_steps=[4], sharded=True),
        _replacement(),
        _replacement(),
    ]
    plan = plan_restore(every)
    assert plan.target is None and plan.source == {2: -1, 3: -1}
    assert plan.why_not == "the replica of rank(s) [2, 3] was lost with them (their buddy too)"


def test_a_sharded_replacement_is_sent_its_whole_state_by_its_buddy() -> None:
    every = [
        _survivor([4, 8], ward=2, ward_steps=[4, 8], sharded=True),
        _survivor([4, 8], ward=0, ward_steps=[4, 8], sharded=True),
        _replacement(),
    ]
    plan = plan_restore(every)
    assert plan.target == 8 and plan.sharded and plan.source == {2: 0} and plan.part_from == {}


def _hsdp(lost: set[int], *, ward_steps: list[int] | None = None) -> list[dict[str, object]]:
    """A 2 x 2 HSDP mesh (replicate peers {0, 2} and {1, 3}; each one's buddy is its peer,
    which keeps only its per-rank part) with the ranks in `lost` replaced."""
    layout = MeshLayout.build(("dp_replicate", "dp_shard"), (2, 2), range(4), world_size=4)
    every: list[dict[str, object]] = []
    for r in range(4):
        peers = layout.replicas(r)
        ward = next(p for p in peers if p != r)
        m = (
            _replacement()
            if r in lost
            else _survivor([4, 5], ward=ward, ward_steps=ward_steps or [4, 5], sharded=True)
        )
        every.append({**m, "peers": peers})
    return every


def test_an_hsdp_replacement_takes_its_shards_from_a_replicate_peers_own_snapshot() -> None:
    plan = plan_restore(_hsdp({3}))
    assert plan.target == 5 and plan.sharded and plan.peered == {3}
    assert plan.source == {3: 1} and plan.part_from == {3: 1} and not plan.whole(3)


def test_hsdp_survives_a_whole_replica_lost_but_not_both_copies_of_a_shard() -> None:
    plan = plan_restore(_hsdp({2, 3}))  # replicate coordinate 1 gone: 0 and 1 hold its shards
    assert plan.target == 5 and plan.source == {2: 0, 3: 1}
    plan = plan_restore(_hsdp({1, 3}))  # both copies of one shard
    assert plan.target is None and plan.source == {1: -1, 3: -1}
    assert plan.why_not == "no replicate peer of rank(s) [1, 3] survived: their shards are gone"


def test_an_hsdp_replacement_goes_back_to_the_step_its_part_reached_its_peer() -> None:
    plan = plan_restore(_hsdp({3}, ward_steps=[4]))  # step 5's part was on its way
    assert plan.target == 4


# ---------------------------------------------------------------- the roll call
WD = WatchdogConfig(timeout_s=60.0, startup_timeout_s=60.0)


def test_the_roll_call_gives_up_on_a_stopped_rank_at_once_and_kills_it() -> None:
    named = [{"rank": 1, "state": "stopped", "pid": 4242}]
    verdict = judge_roll_call(named, waited_s=0.5, generation=2, wd=WD)
    assert verdict is not None and verdict.kill == [4242]
    assert verdict.reason == "rank(s) 1 (stopped) did not arrive for generation 2 in 0.5 s"
    no_kill = WatchdogConfig(timeout_s=60.0, startup_timeout_s=60.0, kill_stopped=False)
    verdict = judge_roll_call(named, waited_s=0.5, generation=2, wd=no_kill)
    assert verdict is not None and verdict.kill == []


def test_the_roll_call_waits_for_a_running_rank_until_the_startup_timeout() -> None:
    named = [{"rank": 3, "state": "running", "pid": 7}]
    assert judge_roll_call(named, waited_s=59.9, generation=1, wd=WD) is None
    verdict = judge_roll_call(named, waited_s=60.0, generation=1, wd=WD)
    assert verdict is not None and verdict.kill == []


# ---------------------------------------------------------------- hang verdicts
def _status(rank: int, *, oom: bool = False) -> RankStatus:
    return RankStatus(rank, 7, "forward", 3, 31.0, 31.0, 30.0, failed=oom, oom=oom)


def _detection(kind: str, *ranks: int, oom: bool = False) -> Detection:
    return Detection(kind, ranks, tuple(_status(r, oom=oom) for r in ranks), ())


def test_a_silent_rank_is_a_hang_when_stopped_and_a_lost_peer_otherwise() -> None:
    det = _detection("no_heartbeat", 1)
    assert judge(det, ["stopped"]) == (ExitCode.HANG, "no heartbeat for 31.0 s")
    assert judge(det, ["dead"])[0] == ExitCode.PEER_LOST
    assert judge(_detection("no_heartbeat", 1, 2), ["stopped", "running"])[0] == (
        ExitCode.PEER_LOST
    )


def test_a_failed_rank_exits_with_its_failure_and_a_stall_as_a_hang() -> None:
    assert judge(_detection("failed", 0, oom=True), [""])[0] == ExitCode.OOM
    assert judge(_detection("failed", 0), [""])[0] == ExitCode.RANK_EXCEPTION
    assert judge(_detection("stalled", 2), [""]) == (
        ExitCode.HANG,
        "no progress past the phase timeout",
    )


def test_only_one_stalled_or_silent_rank_is_replaced_hot() -> None:
    assert hot_eligible(_detection("stalled", 1), hot=True)
    assert hot_eligible(_detection("no_heartbeat", 1), hot=True)
    assert not hot_eligible(_detection("no_heartbeat", 1), hot=False)
    assert not hot_eligible(_detection("stalled", 1, 2), hot=True)
    assert not hot_eligible(_detection("failed", 1), hot=True)


def test_a_hot_verdict_spares_the_ranks_it_does_not_name() -> None:
    verdict = {"hot": True, "ranks": [1]}
    assert spares(verdict, 0) and not spares(verdict, 1)
    assert not spares({"hot": False, "ranks": [1]}, 0)


# ---------------------------------------------------------------- hot mode and store keys
def test_hot_mode_is_read_from_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_HOT, ENV_GENERATION, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)
    assert HotMode.from_env() == HotMode(enabled=False, generation=0, attempt="0")
    monkeypatch.setenv(ENV_HOT, "1")
    monkeypatch.setenv(ENV_GENERATION, "2")
    monkeypatch.setenv(ENV_ATTEMPT, "a7")
    mode = HotMode.from_env()
    assert (mode.enabled, mode.generation, mode.attempt, mode.wait_s) == (True, 2, "a7", HOT_WAIT_S)
    assert mode.rejoining and not HotMode(enabled=True).rejoining
    assert not HotMode(enabled=False, generation=1).rejoining


def test_the_store_keys_keep_their_layout() -> None:
    """The agent and the workers of a running job must agree on every key: a changed layout
    is a protocol change, so it shows here first."""
    keys = storekeys.HotKeys("a7")
    assert keys.published() == "resilient/attempt_a7/hot/gen"
    assert keys.arrived(2, 1) == "resilient/attempt_a7/hot/gen_2/arrived/1"
    assert keys.arrived(2, "all") == "resilient/attempt_a7/hot/gen_2/arrived/all"
    assert keys.formed(2) == "resilient/attempt_a7/hot/gen_2/formed"
    assert keys.stepped(2) == "resilient/attempt_a7/hot/gen_2/stepped"
    assert keys.replaced(2) == "resilient/attempt_a7/hot/gen_2/replaced"
    assert keys.replica(3) == "resilient/attempt_a7/hot/replica/rank_3"
    assert keys.raised(1, 9, "oom", 2) == "resilient/attempt_a7/hot/raised/1/9/oom/2"
    assert storekeys.worker_prefix("a7") == "resilient/attempt_a7"
    assert storekeys.worker_prefix("a7", 2) == "resilient/attempt_a7/gen_2"
    assert storekeys.watchdog_key("a7", 1, storekeys.VERDICT) == (
        "resilient/attempt_a7/gen_1/watchdog/verdict"
    )
    assert storekeys.watchdog_key("a7", 0, storekeys.meta(4)) == (
        "resilient/attempt_a7/watchdog/meta/4"
    )
    assert storekeys.round_key() == "resilient/round"
    assert storekeys.round_key(3) == "resilient/round/3"


# ---------------------------------------------------------------- fault points
def test_fault_points_run_what_is_armed_and_nothing_else() -> None:
    seen: list[dict[str, object]] = []
    faultpoints.hit(faultpoints.SNAPSHOT_COPIED, step=1)  # nothing armed: nothing runs
    try:
        faultpoints.arm(faultpoints.SNAPSHOT_COPIED, lambda **where: seen.append(where))
        faultpoints.hit(faultpoints.SNAPSHOT_COPIED, step=5)
        faultpoints.hit(faultpoints.HOT_ROLL_CALL, generation=1)  # not armed
        assert seen == [{"step": 5}]
        with pytest.raises(KeyError, match=r"no fault point .snapshot\.copy."):
            faultpoints.arm("snapshot.copy", lambda **where: None)
    finally:
        faultpoints.disarm()
    faultpoints.hit(faultpoints.SNAPSHOT_COPIED, step=6)
    assert seen == [{"step": 5}] and faultpoints.armed == {}


def test_every_fault_point_is_hit_somewhere_in_the_runtime() -> None:
    """A point no production code hits any more would silently disarm its chaos faults."""
    import pathlib

    root = pathlib.Path(faultpoints.__file__).parent
    code = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "faultpoints.py")
    names = {
        v: k for k, v in vars(faultpoints).items() if isinstance(v, str) and v in faultpoints.POINTS
    }
    for point, const in names.items():
        assert f"faultpoints.{const}" in code, f"fault point {point} is hit nowhere"


# ---------------------------------------------------------------- cutting a departed peer loose
def test_sever_ends_a_wait_on_exactly_the_connections_to_the_named_endpoints() -> None:
    """groups/sockets.py: a thread blocked reading a connection whose other end is a named
    endpoint returns (end of stream) once it is severed; another connection is untouched."""
    import socket
    import threading

    from resilient.groups import sockets

    server = socket.create_server(("127.0.0.1", 0))
    peers = [socket.create_connection(server.getsockname()) for _ in range(2)]
    accepted = [server.accept()[0] for _ in range(2)]
    try:
        ends = {s.getsockname() for s in peers}
        assert ends <= set(sockets.endpoints())  # this process's own established ends
        got: list[bytes] = []
        by_peer = {a.getpeername(): a for a in accepted}
        waiting = by_peer[peers[0].getsockname()]
        reader = threading.Thread(target=lambda: got.append(waiting.recv(1)))
        reader.start()
        assert sockets.sever({peers[0].getsockname()}) == 1
        reader.join(timeout=5)
        assert got == [b""]  # the wait ended
        other = by_peer[peers[1].getsockname()]
        peers[1].sendall(b"x")
        assert other.recv(1) == b"x"  # the other connection still works
    finally:
        for s in [*peers, *accepted, server]:
            s.close()


def test_a_stuck_rank_says_so_once_its_generation_is_over_and_cuts_the_others_who_did() -> None:
    """hang/departed.py: no survivor left, but the agent published the next generation
    (`generation_over`): a rank whose main thread has not moved appends itself to the `left`
    key (stuck), once, and cuts its connections to every other rank there, which ends its
    wait on them. Before the generation is over, or while its main thread moves, nothing."""
    import json
    import socket
    import threading
    import time

    import torch.distributed as dist

    from resilient.hang.departed import Departures, generation_over
    from resilient.hang.phases import Progress

    launcher = dist.HashStore()
    store = dist.PrefixStore(storekeys.WATCHDOG, launcher)
    hot = HotMode(enabled=True, generation=0, attempt="7")
    deps = Departures(0, stuck_s=0.05, lost=generation_over(launcher, hot))
    progress = Progress()
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())  # rank 2's end
    mine = server.accept()[0]  # rank 0's end, waited on
    try:
        progress.since = time.monotonic()
        assert deps.poll(store, progress) == 0  # moving: nothing
        progress.since -= 1.0
        assert deps.poll(store, progress) == 0 and not store.check([storekeys.LEFT])
        launcher.set(hot.keys.published(), "1")  # the agent started generation 1
        line = {"rank": 2, "step": 5, "endpoints": [list(peer.getsockname())], "stuck": True}
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(mine.recv(1)))
        reader.start()
        store.append(storekeys.LEFT, json.dumps(line) + "\n")
        assert deps.poll(store, progress) == 1  # said so, and cut rank 2
        reader.join(timeout=5)
        assert got == [b""]
        lines = [json.loads(x) for x in bytes(store.get(storekeys.LEFT)).decode().splitlines()]
        assert [(x["rank"], x["stuck"]) for x in lines] == [(2, True), (0, True)]
        assert deps.poll(store, progress) == 0  # once
        assert len(bytes(store.get(storekeys.LEFT)).decode().splitlines()) == 2
    finally:
        for s in (peer, mine, server):
            s.close()
