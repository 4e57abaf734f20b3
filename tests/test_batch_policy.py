"""A global batch for every world size of --nnodes MIN:MAX (issue 49): N launchers on one host
with --nnodes N-1:N and the rendezvous store apart (`resilient rendezvous`); the first
launcher's whole tree is SIGKILLed mid-run. The survivors re-form on N-1 ranks and finish with
exit 0. Three launchers of 4 samples a rank (12), where 2 ranks of 4 cannot split 12, under
each batch policy (in CI):

- exact: 2 micro-batches of 3 per rank, 12 samples every step, as an undisturbed run;
- follow: the per-rank batch kept, 8 samples a step from the change on, said in one event.

In `make soak` (extended): 4 launchers of 6 (24) to 3 (exact: 2 micro-batches of 4), and 2 to
1, the case that worked before, for the time from the kill to the next step side by side.
Every step's samples are checked against the sampler's order: no sample skipped or seen twice.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SUPERVISED_WORKER,
    free_port,
    kill_tree,
    last_by_step,
    records,
    run_cmd,
    run_events,
    spawn,
    wait_for,
)

from recipes.common.data import build_dataset

STEPS = 24


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT)


def _launcher(
    tmp: Path, name: str, port: int, policy: str, nodes: int, batch: int
) -> subprocess.Popen[bytes]:
    cmd = run_cmd(
        f"--nnodes={nodes - 1}:{nodes}",
        "--nproc-per-node=1",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-external",
        f"--rdzv-id=batch-{policy}",
        "--rdzv-conf=last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=2,"
        "join_timeout=120",
        f"--run-dir={tmp / ('run' + name)}",
        f"--checkpoint-url={tmp / 'ckpt'}",
        f"--batch-policy={policy}",
        f"--per-rank-batch={batch}",
        f"--global-batch={batch * nodes}",
        "--restart-backoff=0.2",
        "--restart-jitter=0",
        "--no-health-check",
        "--status=off",
        str(SUPERVISED_WORKER),
        f"--record={tmp / 'rec'}",
        f"--steps={STEPS}",
        "--save-every=4",
        "--sleep=0.3",
        f"--batch={batch}",
        # explicit, so a first round that forms short of a node (a late launcher on a loaded
        # machine) keeps the same global batch: B x N, as a round of N would default to
        f"--global-batch={batch * nodes}",
        '--watchdog={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, '
        '"timeout_s": 30, "startup_timeout_s": 60}',
    )
    return _start(cmd, tmp / f"{name}.log")


def _samples(rec: Path) -> list[tuple[int, int, int]]:
    """(world size, micro-batches, samples) per step; every step took the next samples of the
    epoch's order under DistributedSampler(shuffle=True, seed=0), whatever world ran it."""
    n = len(build_dataset(block_size=16, num_chars=40_000, seed=0)[0])  # as the worker's
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    final = last_by_step(records(rec))
    assert sorted(final) == list(range(STEPS))
    at, shape = 0, []
    for step, recs in final.items():
        ids = sorted(i for r in recs for i in r["ids"])
        assert ids == sorted(order[at : at + len(ids)]), step
        assert len({r["world"] for r in recs}) == 1 and len(recs) == recs[0]["world"]
        at += len(ids)
        shape.append((recs[0]["world"], recs[0]["accum"], len(ids)))
    return shape


def _flags(**kw: Any) -> Any:
    import argparse

    base = {"batch_policy": None, "per_rank_batch": None, "global_batch": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.timeout(30)
def test_the_start_up_table_says_what_it_knows_and_what_it_assumes(tmp_path: Path) -> None:
    from resilient.supervisor.batchplan import plan

    lines, fields = plan(_flags(), 2, 4, 8, str(tmp_path))
    assert len(lines) == 1 and "not known before the workers start" in lines[0]
    assert "--per-rank-batch" in lines[0] and "never exit 80" in lines[0]
    assert fields["per_rank_batch"] is None
    lines, fields = plan(_flags(per_rank_batch=8), 2, 4, 8, str(tmp_path))
    assert "global batch 256 (8 per rank x 32 ranks, assumed" in lines[0]
    assert fields["nodes"]["4"]["how"] == "kept" and fields["nodes"]["2"]["accum"] == 2
    assert fields["nodes"]["3"]["how"] == "follows"  # 256 has no equal shares on 24 ranks
    lines, _ = plan(_flags(per_rank_batch=8, batch_policy="follow"), 2, 3, 1, str(tmp_path))
    assert lines[1].endswith(
        "follows the world: global batch 16 (batch policy follow: the per-rank batch 8 is kept)"
    ), lines
    # a requeue: what the workers of the last attempt logged, a mesh's dp share included
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.jsonl").write_text(
        '{"event": "data.batch", "global_batch": 24, "per_rank_batch": 4, "dp": 3, '
        '"world_size": 6, "rank": 0}\n'
    )
    lines, fields = plan(_flags(), 2, 3, 2, str(tmp_path))
    assert "global batch 24 (the run's last attempt)" in lines[0], lines
    assert "2 node(s), 2 data-parallel rank(s): kept: 3 micro-batch(es) of 4" in lines[1]
    lines, _ = plan(_flags(global_batch=40), 2, 3, 2, str(tmp_path))
    assert "global batch 40 (--global-batch)" in lines[0]


@pytest.mark.timeout(30)
def test_the_batch_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    from resilient.supervisor.config import UsageError, parse_command_line

    script = tmp_path / "train.py"
    script.write_text("")
    _, args = parse_command_line(["--batch-policy=follow", "--per-rank-batch=8", str(script)])
    assert (args.batch_policy, args.per_rank_batch, args.global_batch) == ("follow", 8, None)
    with pytest.raises(UsageError, match="--per-rank-batch must be >= 1"):
        parse_command_line(["--per-rank-batch=0", str(script)])
    with pytest.raises(UsageError, match="--global-batch must be >= 1"):
        parse_command_line(["--global-batch=-3", str(script)])
    with pytest.raises(SystemExit):  # argparse's own choices: exit 2, nothing started
        parse_command_line(["--batch-policy=fast", str(script)])


def test_a_worker_refuses_an_unknown_batch_policy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from resilient.errors import ConfigError
    from resilient.runtime.config import build_config

    monkeypatch.setenv("RESILIENT_BATCH_POLICY", "follow")
    assert build_config(str(tmp_path), {}).batch_policy == "follow"
    assert build_config(str(tmp_path), {"batch_policy": "exact"}).batch_policy == "exact"
    monkeypatch.delenv("RESILIENT_BATCH_POLICY")
    assert build_config(str(tmp_path), {}).batch_policy == "exact"
    with pytest.raises(ConfigError, match="batch_policy must be one of exact, follow"):
        build_config(str(tmp_path), {"batch_policy": "fast"})


CASES = [
    # nodes, policy, per-rank batch, (world, micro-batches, samples) of each step after the loss
    pytest.param(3, "exact", 4, (2, 2, 12), id="3to2-exact"),
    pytest.param(3, "follow", 4, (2, 1, 8), id="3to2-follow"),
    pytest.param(4, "exact", 6, (3, 2, 24), id="4to3-exact", marks=pytest.mark.extended),
    pytest.param(2, "exact", 4, (1, 2, 8), id="2to1-before", marks=pytest.mark.extended),
]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("nodes", "policy", "batch", "after"), CASES)
def test_launchers_lose_the_first_and_the_others_finish_under_each_policy(
    tmp_path: Path, nodes: int, policy: str, batch: int, after: tuple[int, int, int]
) -> None:
    t0 = time.monotonic()
    port = free_port()
    rec, ckpt = tmp_path / "rec", tmp_path / "ckpt"
    procs: list[subprocess.Popen[Any]] = []
    names = "ABCD"[:nodes]

    def log(name: str, tail: int = 4000) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")[-tail:]

    def committed() -> int:
        done = [int(d.name[5:]) for d in ckpt.glob("step_*") if (d / "manifest.json").exists()]
        return max(done, default=-1)

    def at(world: int) -> list[dict[str, Any]]:
        return [r for r in records(rec) if r["world"] == world and r["rank"] == 0]

    try:
        store_log = tmp_path / "store.jsonl"
        server = [sys.executable, "-m", "resilient.cli", "rendezvous", "--host=127.0.0.1"]
        procs.append(_start([*server, f"--port={port}", f"--log-file={store_log}"], store_log))
        wait_for(
            lambda: store_log.exists() and '"rendezvous.serving"' in store_log.read_text(),
            timeout=60,
            what="resilient rendezvous serving",
        )
        agents = [_launcher(tmp_path, n, port, policy, nodes, batch) for n in names]
        procs += agents
        wait_for(lambda: len(at(nodes)) >= 2 and committed() >= 4, timeout=240, what="every node")
        killed = time.time()
        kill_tree(agents[0].pid, groups=(agents[0].pid,))  # A: its agent and its worker
        for i in range(1, nodes):
            assert agents[i].wait(timeout=240) == 0, log(names[i])
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
            kill_tree(p.pid, groups=(p.pid,))
    next_step = min(r["t"] for r in at(nodes - 1)) - killed
    shape = _samples(rec)
    assert shape[-1][0] == nodes - 1, shape
    assert {s for s in shape if s[0] == nodes} == {(nodes, 1, batch * nodes)}, shape
    assert {s for s in shape if s[0] == nodes - 1} == {after}, shape
    survivors = [tmp_path / f"run{n}" for n in names[1:]]
    table = log("B", 0)
    whole = f"{nodes} node(s), {nodes} data-parallel rank(s): kept: 1 micro-batch(es) of {batch}"
    assert whole in table, table[:3000]
    world, accum, samples = after
    if samples == batch * nodes and accum * world * batch != samples:  # exact, smaller parts
        said = [e for r in survivors for e in run_events(r, "data.batch_exact")]
        micro = samples // world // accum
        assert said and {(e["micro_batch"], e["grad_accum"]) for e in said} == {(micro, accum)}
        assert all(e["bitwise"] is False and "bits differ" in e["reason"] for e in said)
        assert f"kept exactly: {accum} micro-batch(es) of {micro} per rank" in table
    elif samples != batch * nodes:  # the global batch followed the world
        said = [e for r in survivors for e in run_events(r, "data.batch_follows")]
        assert {(e["old_global_batch"], e["new_global_batch"]) for e in said} == {
            (batch * nodes, samples)
        }
        assert len([e for e in said if e["rank"] == 0]) == 1  # one event, not one per step
        assert f"follows the world: global batch {samples}" in table
    assert not [e for r in survivors for e in run_events(r, "restart.mismatch")]  # never 80
    assert not [e for r in survivors for e in run_events(r, "data.accum_ignored")]
    print(
        f"{nodes} launchers to {nodes - 1}, {policy}: kill to the next step {next_step:.1f} s, "
        f"{time.monotonic() - t0:.1f} s in all"
    )
