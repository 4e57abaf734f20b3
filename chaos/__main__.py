"""python -m chaos: run scenarios against real runs and check the invariants.

python -m chaos run FILE.toml [FILE.toml ...]   run the given scenarios
python -m chaos matrix                          every scenario in chaos/scenarios/ (CI's set)
python -m chaos soak --seed 7 --runs 200        seeded random fault schedules
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chaos.procs import REPO
from chaos.runner import describe, run_scenario
from chaos.scenario import Scenario, generate

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
    args = p.parse_args(argv)

    if args.cmd == "run":
        scenarios = [Scenario.load(f) for f in args.files]
    elif args.cmd == "matrix":
        scenarios = [Scenario.load(f) for f in sorted(SCENARIOS.glob("*.toml"))]
    else:
        scenarios = generate(args.seed, args.runs)
    passed = 0
    for sc in scenarios:
        result = run_scenario(sc, args.out, keep=args.keep)
        print(describe(result), flush=True)
        passed += result.ok
    print(f"chaos: {passed} passed, {len(scenarios) - passed} failed")
    return 0 if passed == len(scenarios) else 1


if __name__ == "__main__":
    sys.exit(main())
