"""A global batch for every world size of --nnodes MIN:MAX (issue 49): three launchers on one
host with --nnodes 2:3 and the rendezvous store apart (`resilient rendezvous`); the first
launcher's whole tree is SIGKILLed mid-run. The two survivors re-form on 2 ranks, where the
loader's 4 samples a rank cannot split the global batch of 12, and finish with exit 0 under
each batch policy:

- exact: 2 micro-batches of 3 per rank, 12 samples every step, as an undisturbed run;
- follow: the per-rank batch kept, 8 samples a step from the change on, said in one event.

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
BATCH = 4  # per rank: 12 on 3 ranks, which 2 ranks of 4 cannot split


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT)


def _launcher(tmp: Path, name: str, port: int, policy: str) -> subprocess.Popen[bytes]:
    cmd = run_cmd(
        "--nnodes=2:3",
        "--nproc-per-node=1",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-external",
        f"--rdzv-id=batch-{policy}",
        "--rdzv-conf=last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=2,"
        "join_timeout=120",
        f"--run-dir={tmp / ('run' + name)}",
        f"--checkpoint-url={tmp / 'ckpt'}",
        f"--batch-policy={policy}",
        f"--per-rank-batch={BATCH}",
        "--restart-backoff=0.2",
        "--restart-jitter=0",
        "--no-health-check",
        "--status=off",
        str(SUPERVISED_WORKER),
        f"--record={tmp / 'rec'}",
        f"--steps={STEPS}",
        "--save-every=4",
        "--sleep=0.3",
        f"--batch={BATCH}",
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


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("policy", ["exact", "follow"])  # 20 s each, quiet
def test_three_launchers_lose_the_first_and_two_finish_under_each_policy(
    tmp_path: Path, policy: str
) -> None:
    t0 = time.monotonic()
    port = free_port()
    rec, ckpt = tmp_path / "rec", tmp_path / "ckpt"
    procs: list[subprocess.Popen[Any]] = []

    def log(name: str, tail: int = 4000) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")[-tail:]

    def committed() -> int:
        done = [int(d.name[5:]) for d in ckpt.glob("step_*") if (d / "manifest.json").exists()]
        return max(done, default=-1)

    try:
        store_log = tmp_path / "store.jsonl"
        server = [sys.executable, "-m", "resilient.cli", "rendezvous", "--host=127.0.0.1"]
        procs.append(_start([*server, f"--port={port}", f"--log-file={store_log}"], store_log))
        wait_for(
            lambda: store_log.exists() and '"rendezvous.serving"' in store_log.read_text(),
            timeout=60,
            what="resilient rendezvous serving",
        )
        agents = [_launcher(tmp_path, name, port, policy) for name in "ABC"]
        procs += agents
        three = lambda: [r for r in records(rec) if r["world"] == 3 and r["rank"] == 0]  # noqa: E731
        wait_for(lambda: len(three()) >= 2 and committed() >= 4, timeout=240, what="3 ranks")
        kill_tree(agents[0].pid, groups=(agents[0].pid,))  # A: its agent and its worker
        for i in (1, 2):
            assert agents[i].wait(timeout=240) == 0, log("ABC"[i])
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
            kill_tree(p.pid, groups=(p.pid,))
    shape = _samples(rec)
    assert shape[0] == (3, 1, 12) and shape[-1][0] == 2, shape
    two = {s for s in shape if s[0] == 2}
    survivors = [tmp_path / "runB", tmp_path / "runC"]
    if policy == "exact":
        assert two == {(2, 2, 12)}  # 2 micro-batches of 3 a rank: the global batch kept
        said = [e for r in survivors for e in run_events(r, "data.batch_exact")]
        assert said and {(e["micro_batch"], e["grad_accum"]) for e in said} == {(3, 2)}
        assert all(e["bitwise"] is False and "bits differ" in e["reason"] for e in said)
        assert "kept exactly: 2 micro-batch(es) of 3 per rank" in log("B", 0)
    else:
        assert two == {(2, 1, 8)}  # the per-rank batch kept: the global batch follows
        said = [e for r in survivors for e in run_events(r, "data.batch_follows")]
        assert said and {(e["old_global_batch"], e["new_global_batch"]) for e in said} == {(12, 8)}
        assert len([e for e in said if e["rank"] == 0]) == 1  # one event, not one per step
        assert "follows the world: global batch 8" in log("B", 0)
    assert "3 node(s), 3 data-parallel rank(s): kept: 1 micro-batch(es) of 4" in log("B", 0)
    assert not [e for r in survivors for e in run_events(r, "restart.mismatch")]  # never 80
    print(f"three launchers, first killed, {policy}: {time.monotonic() - t0:.1f} s")
