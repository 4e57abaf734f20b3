"""The rendezvous store apart from the job (issue 38): what losing the first node costs, and
what a rendezvous round costs.

    python scripts/bench_rdzv.py                 # both parts, 2 kills of each kind, 3x10 rounds
    python scripts/bench_rdzv.py --part rounds   # only the rendezvous rounds (no root needed)
    python scripts/bench_rdzv.py --today         # also today's node-hosted store losing host 0

Kills (root: network namespaces, chaos.netns.Lan): three hosts run `resilient run --nnodes
2:3 --rdzv-external` (tests/workers/supervised_train.py, one rank each, a checkpoint every
4 steps), `resilient rendezvous` serves the store on a fourth. Once a checkpoint is
committed on three hosts, every process of one host is killed: host 0 (the group's rank 0,
whose agent hosts the workers' store of the round) or host 1. Timed from the kill to the
first step that both survivors complete in the new world of 2 (the record's time). The kinds
alternate (first, other, first, other, ...); the figure is the median of each and the ratio
first/other (target <= 1.2). With --today, one more launch with the store hosted by host 0's
agent (torch's default, `--rdzv-backend c10d` without --rdzv-external): what host 0's loss
does to the survivors (their exit codes and when).

Rounds (loopback, no root needed): three node processes, each torch's own c10d handler as
`resilient run` builds it, run 10 rendezvous rounds of 3 nodes (`--nnodes 3:3`): against
`resilient rendezvous` (every node a client) and against the store hosted by node 0's
handler (today's c10d), alternated, 3 launches each. A round's time: from the last node's
call of next_rendezvous to the last node's return. Median over all rounds of each kind and
the ratio external/hosted (target <= 1.5).

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.netns import Lan, netns_unavailable  # noqa: E402
from chaos.procs import spawn, wait_for  # noqa: E402
from chaos.ranks import free_port  # noqa: E402
from resilient.events import read_events  # noqa: E402
from resilient.proctree import kill_tree  # noqa: E402

WORKER = REPO / "tests" / "workers" / "supervised_train.py"


def _serving(log: Path) -> bool:
    return log.exists() and "rendezvous.serving" in log.read_text()


# ---------------------------------------------------------------------- rounds
def _node(endpoint: str, host: bool, rounds: int, out: str) -> None:
    """One node: `rounds` rendezvous rounds; one JSON line per round."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as resilient run sets it
    params = RendezvousParameters(
        backend="c10d",
        endpoint=endpoint,
        run_id="bench",
        min_nodes=3,
        max_nodes=3,
        is_host=host,
        join_timeout="120",
    )
    h = registry.get_rendezvous_handler(params)
    with open(out, "w") as f:
        for r in range(rounds):
            t0 = time.time()
            info = h.next_rendezvous()
            t1 = time.time()
            f.write(json.dumps({"round": r, "call": t0, "done": t1, "rank": info.rank}) + "\n")
            f.flush()
    time.sleep(2)  # node 0 may host the store: leave after the others read their last round


def _rounds_once(kind: str, rounds: int, tmp: Path) -> list[float]:
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[Any]] = []
    try:
        if kind == "external":
            log = tmp / f"store{port}.jsonl"
            cmd = [sys.executable, "-m", "resilient.cli", "rendezvous", f"--port={port}"]
            procs.append(
                spawn([*cmd, "--host=127.0.0.1", f"--log-file={log}"], stderr=subprocess.DEVNULL)
            )
            wait_for(
                lambda: log.exists() and "serving" in log.read_text(), timeout=60, what="store"
            )
        outs = [tmp / f"{kind}{port}-{i}.jsonl" for i in range(3)]
        for i in range(3):
            host = kind == "hosted" and i == 0
            code = (
                "import sys; sys.path.insert(0, sys.argv[1]); from bench_rdzv import _node; "
                "_node(sys.argv[2], sys.argv[3] == '1', int(sys.argv[4]), sys.argv[5])"
            )
            args = [str(REPO / "scripts"), endpoint, str(int(host)), str(rounds), str(outs[i])]
            procs.append(spawn([sys.executable, "-c", code, *args], stderr=subprocess.DEVNULL))
        for p in procs[-3:]:
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"a {kind} node failed")
        per = [[json.loads(x) for x in o.read_text().splitlines()] for o in outs]
        return [
            max(n[r]["done"] for n in per) - max(n[r]["call"] for n in per) for r in range(rounds)
        ]
    finally:
        for p in procs:
            kill_tree(p.pid, groups=(p.pid,))


def bench_rounds(launches: int, rounds: int) -> dict[str, Any]:
    got: dict[str, list[float]] = {"external": [], "hosted": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(launches):
            for kind in ("external", "hosted") if i % 2 == 0 else ("hosted", "external"):
                times = _rounds_once(kind, rounds, Path(d))
                got[kind] += times[1:]  # the first round pays the nodes' start-up skew
                print(f"[rounds] {kind}: median {statistics.median(times[1:]):.4f} s", flush=True)
    ext, hosted = statistics.median(got["external"]), statistics.median(got["hosted"])
    return {
        "round_s_external": round(ext, 4),
        "round_s_hosted": round(hosted, 4),
        "round_ratio": round(ext / hosted, 3),
        "rounds_each": len(got["external"]),
    }


# ---------------------------------------------------------------------- kills
def _agent(lan: Lan, i: int, tmp: Path, store: int, external: bool) -> subprocess.Popen[Any]:
    endpoint = f"{lan.addr[3]}:29400" if external else f"{lan.addr[0]}:29400"
    rdzv = ["--rdzv-external"] if external else [f"--rdzv-conf=is_host={int(i == 0)}"]
    # generous: on this shared 2-core machine a shorter last call formed the first round
    # without the third node, which then waited for a membership change (both kinds pay it
    # once more after the kill, so the ratio keeps its meaning)
    conf = "last_call_timeout=10,keep_alive_interval=3,keep_alive_max_attempt=2,join_timeout=600"
    cmd = [
        *lan.exec_prefix(i),
        sys.executable, "-m", "resilient.cli", "run",
        "--nnodes=2:3", "--nproc-per-node=1", f"--rdzv-endpoint={endpoint}", *rdzv,
        "--rdzv-id=bench", f"--rdzv-conf={conf}", f"--local-addr={lan.addr[i]}",
        f"--run-dir={tmp / f'run{i}'}", f"--checkpoint-url={tmp / 'ckpt'}",
        "--restart-backoff=0.2", "--restart-jitter=0", "--status=off",
        str(WORKER), f"--record={tmp / 'rec'}", "--steps=400", "--save-every=4",
        "--sleep=0.25", "--batch=2", "--global-batch=12",
        '--watchdog={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, '
        '"timeout_s": 30, "startup_timeout_s": 60}',
    ]  # fmt: skip
    with (tmp / f"agent{i}.log").open("ab") as out:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT)


def _kill_once(victim: int, tmp: Path, *, external: bool = True) -> dict[str, Any]:
    """Three hosts; kill every process of host `victim` once a checkpoint is committed."""
    lan = Lan(4)
    procs: list[subprocess.Popen[Any]] = []
    rec, ckpt = tmp / "rec", tmp / "ckpt"

    def recs() -> list[dict[str, Any]]:
        return read_events(rec, pattern="rank*.jsonl")

    def committed() -> int:
        done = [int(d.name[5:]) for d in ckpt.glob("step_*") if (d / "manifest.json").exists()]
        return max(done, default=-1)

    try:
        lan.up()
        if external:
            log = tmp / "store.jsonl"
            cmd = [sys.executable, "-m", "resilient.cli", "rendezvous", f"--host={lan.addr[3]}"]
            procs.append(
                spawn(
                    [*lan.exec_prefix(3), *cmd, "--port=29400", f"--log-file={log}"],
                    stderr=subprocess.DEVNULL,
                )
            )
            wait_for(
                lambda: log.exists() and "serving" in log.read_text(), timeout=60, what="store"
            )
        agents = [_agent(lan, i, tmp, 29400, external) for i in range(3)]
        procs += agents
        wait_for(
            lambda: committed() >= 4 and any(r["world"] == 3 for r in recs()),
            timeout=600,
            what="a checkpoint on three hosts",
        )
        starts = [
            e for e in read_events(tmp / f"run{victim}", "attempt.start") if e["world_size"] == 3
        ]
        t_kill = time.time()
        lan.kill(victim)
        if not external:
            codes = {i: agents[i].wait(timeout=300) for i in range(3) if i != victim}
            return {"survivor_exit_codes": codes, "exit_after_s": round(time.time() - t_kill, 2)}

        def next_step() -> float | None:
            after = [r for r in recs() if r["world"] == 2 and r["t"] > t_kill]
            steps = {r["step"] for r in after}
            for s in sorted(steps):  # the first step both survivors completed
                ts = [r["t"] for r in after if r["step"] == s]
                if len(ts) == 2:
                    return max(ts)
            return None

        t_next = wait_for(next_step, timeout=600, what="a step on the two survivors")
        return {"kill_to_step_s": round(t_next - t_kill, 3), "victim_node": starts[-1]["node"]}
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        lan.down()
        for p in procs:
            kill_tree(p.pid, groups=(p.pid,))
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def bench_kills(repeats: int, today: bool) -> dict[str, Any]:
    why = netns_unavailable()
    if why:
        return {"kills": f"skipped: {why}"}
    got: dict[str, list[float]] = {"first": [], "other": []}
    out_dir = REPO / "bench-output" / "rdzv"
    for n in range(repeats):
        for kind, victim in (("first", 0), ("other", 1)):
            d = out_dir / f"{kind}{n}"  # kept when a launch fails, for its logs
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            r = _kill_once(victim, d)
            shutil.rmtree(d, ignore_errors=True)
            if r["victim_node"] != victim:
                print(f"[kills] host {victim} was group rank {r['victim_node']}", flush=True)
            got[kind].append(r["kill_to_step_s"])
            print(f"[kills] {kind}: {r['kill_to_step_s']:.2f} s", flush=True)
    first, other = statistics.median(got["first"]), statistics.median(got["other"])
    out: dict[str, Any] = {
        "kill_first_s": round(first, 3),
        "kill_other_s": round(other, 3),
        "kill_ratio": round(first / other, 3),
        "kills": got,
    }
    if today:
        d = out_dir / "today"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        out["today_first"] = _kill_once(0, d, external=False)
        shutil.rmtree(d, ignore_errors=True)
        print(f"[kills] today, host 0 lost: {out['today_first']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "kills", "rounds"), default="all")
    p.add_argument("--repeats", type=int, default=2, help="kills of each kind")
    p.add_argument("--launches", type=int, default=3, help="round launches of each kind")
    p.add_argument("--rounds", type=int, default=10, help="rounds per launch")
    p.add_argument("--today", action="store_true", help="also today's node-hosted store")
    args = p.parse_args()
    result: dict[str, Any] = {}
    if args.part in ("all", "rounds"):
        result.update(bench_rounds(args.launches, args.rounds))
    if args.part in ("all", "kills"):
        result.update(bench_kills(args.repeats, args.today))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
