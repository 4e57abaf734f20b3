"""python -m chaos: run scenarios against real runs and check the invariants.

python -m chaos run FILE.toml [FILE.toml ...]   run the given scenarios
python -m chaos matrix                          every scenario in chaos/scenarios/ (CI's set)
python -m chaos soak --seed 7 --runs 200        seeded random fault schedules
python -m chaos soak --seed 7 --runs 200 --jobs 2 --summary soak.json
python -m chaos run chaos/scenarios/hot_in_process.toml   a hot-mode scenario (hot = true)
python -m chaos summary soak.json                a soak's results as a Markdown table
python -m chaos repeat --kind sigstop --recipe train_fsdp.py --runs 30 --seed 31 --hot
                                                one fault kind, seeded, with hot/cold counts
python -m chaos run chaos/scenarios/nan_hot.toml   a numerical fault (issue 27)
python -m chaos repeat --kind bad_batch --numeric '{"policy": "skip"}' --runs 5
python -m chaos repeat --kind bitflip --nproc 3 --runs 5    silent data corruption (DDP)
python -m chaos run chaos/scenarios/mesh_resize_dp.toml  a 4-rank mesh resized to 2 (issue 36)

A failing scenario keeps its directory (scenario.toml, stdout.log, run/logs, result.json)
and prints the one command that runs it again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from chaos.draw import generate, repeated
from chaos.procs import REPO
from chaos.runner import Result, describe, run_scenario
from chaos.scenario import FAULT_KINDS, Scenario

SCENARIOS = Path(__file__).parent / "scenarios"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "chaos-output",
        help="run directories (a failing scenario's is kept)",
    )
    p.add_argument("--keep", action="store_true", help="keep passing runs' directories too")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("files", nargs="+", type=Path)
    sub.add_parser("matrix")
    s = sub.add_parser("soak")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--runs", type=int, default=200)
    s.add_argument("--first", type=int, default=0, help="skip the schedules before this one")
    s.add_argument(
        "--hot-fraction",
        type=float,
        default=0.25,
        help="the share of runs in hot mode (drawn from the seed; 0: cold only)",
    )
    s.add_argument(
        "--numeric-fraction",
        type=float,
        default=0.1,
        help="the share of runs with a numerical fault instead (nan, spike, bad_batch, "
        "bitflip; from a generator of its own: the other runs keep their schedules; 0: none)",
    )
    s.add_argument(
        "--mesh-fraction",
        type=float,
        default=0.1,
        help="the share of runs on a 4-rank mesh instead (recipes/train_nd.py: dp x tp or "
        "replicate x shard; kill, sigstop, nan, resize; from a generator of its own; 0: none)",
    )
    rep = sub.add_parser("repeat", help="one fault kind, seeded, with hot/cold counts")
    rep.add_argument("--kind", required=True, choices=sorted(FAULT_KINDS))
    rep.add_argument("--recipe", default="train_ddp.py", choices=["train_ddp.py", "train_fsdp.py"])
    rep.add_argument("--runs", type=int, default=30)
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--hot", action="store_true", help="hot mode (--hot-recovery)")
    rep.add_argument(
        "--numeric",
        type=json.loads,
        default=None,
        help='RESILIENT_NUMERIC for the runs, a JSON object (e.g. \'{"policy": "skip"}\'); '
        "a spike gets spike detection without it, a bitflip the replica check (sdc_every 3)",
    )
    rep.add_argument("--nproc", type=int, default=2, help="ranks (bitflip: 3 names the rank)")
    summ = sub.add_parser("summary", help="a soak's --summary JSON as a Markdown table")
    summ.add_argument("file", type=Path)
    for q in (r, s, rep):
        q.add_argument("--jobs", type=int, default=1, help="scenarios run side by side")
        q.add_argument("--summary", type=Path, default=None, help="write every result as JSON")
    args = p.parse_args(argv)

    if args.cmd == "summary":
        from chaos.summary import main as summary

        return summary(args.file)
    if args.cmd == "run":
        scenarios = [Scenario.load(f) for f in args.files]
    elif args.cmd == "matrix":
        scenarios = [Scenario.load(f) for f in sorted(SCENARIOS.glob("*.toml"))]
    elif args.cmd == "repeat":
        scenarios = repeated(
            args.kind,
            args.recipe,
            args.seed,
            args.runs,
            hot=args.hot,
            numeric=args.numeric,
            nproc=args.nproc,
        )
    else:
        from chaos.launch import hot_recovery_unavailable

        # lost-process faults in hot runs only where `resilient run --hot-recovery` exists
        hot_lost = args.hot_fraction > 0 and hot_recovery_unavailable() is None
        scenarios = generate(
            args.seed,
            args.runs,
            hot_fraction=args.hot_fraction,
            hot_lost=hot_lost,
            numeric_fraction=args.numeric_fraction,
            mesh_fraction=args.mesh_fraction,
        )[args.first :]
    started = time.monotonic()
    jobs = max(1, getattr(args, "jobs", 1))
    summary_path: Path | None = getattr(args, "summary", None)
    with ThreadPoolExecutor(jobs) as pool:  # each scenario is its own process tree
        results = []
        for result in pool.map(lambda sc: run_scenario(sc, args.out, keep=args.keep), scenarios):
            print(describe(result), flush=True)
            results.append(result)
            if summary_path:  # after every result: a soak cut short keeps what it ran
                _write_summary(summary_path, results)
    passed = sum(r.ok and not r.skipped for r in results)
    skipped = sum(bool(r.skipped) for r in results)
    failed = len(results) - passed - skipped
    wall = time.monotonic() - started
    print(f"chaos: {passed} passed, {failed} failed, {skipped} skipped in {wall:.0f} s")
    if args.cmd == "repeat":
        print(
            json.dumps(
                {
                    "kind": args.kind,
                    "recipe": args.recipe,
                    "hot_mode": args.hot,
                    "runs": len(results),
                    **_recovery_counts(results),
                }
            )
        )
    return 0 if failed == 0 else 1


def _recovery_counts(results: list[Result]) -> dict[str, int]:
    """How each run's fault was recovered (check g, from the events), and how many passed
    every invariant (a: the final weights bitwise equal to the fault-free run's)."""
    counts = {"hot": 0, "cold": 0, "other": 0, "passed": 0}
    for r in results:
        got = r.checks.get("g_recovery", "").split(": ")[-1].split(" ")[0]
        counts[got if got in ("hot", "cold") else "other"] += 1
        counts["passed"] += r.ok and not r.skipped
    return counts


def _write_summary(path: Path, results: list[Result]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
