"""Run a training script with in-process faults armed (see chaos/faults.py for the specs).

    python -m chaos.inject --fault oom@rank=1,step=5,phase=forward -- recipes/train_ddp.py ARGS
    torchrun --nproc-per-node 3 -m chaos.inject --fault hang@rank=1,step=4 -- recipes/train_ddp.py

The script runs as __main__ in this process (runpy), with its own directory first on
sys.path and sys.argv set to it and its arguments, as `python script.py ARGS` would.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from chaos.faults import KINDS, install, parse


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m chaos.inject --fault SPEC [...] -- script.py [ARGS]")
    cut = argv.index("--")
    p = argparse.ArgumentParser(
        prog="python -m chaos.inject",
        description=__doc__.splitlines()[0],
        epilog="fault kinds: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()),
    )
    p.add_argument("--fault", action="append", default=[], help="KIND@rank=R,step=S,phase=P")
    args = p.parse_args(argv[:cut])
    rest = argv[cut + 1 :]
    if not rest:
        p.error("no script after --")
    try:
        faults = [parse(spec) for spec in args.fault]
    except ValueError as e:
        p.error(str(e))
    script = os.path.abspath(rest[0])
    sys.argv = [script, *rest[1:]]
    sys.path.insert(0, os.path.dirname(script))
    install(faults)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
