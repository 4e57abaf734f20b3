"""Where a verified checkpoint load's time goes: cProfile of rank 0's `load_latest`.

    .venv/bin/torchrun --nproc-per-node 2 scripts/profile_load.py --layers 85 --out DIR

Saves FSDP2 + AdamW state of `--layers` x Linear(2048, 2048) on 2 ranks (85 layers: about
4 GiB, 21: about 1 GiB) to DIR, then loads it `--reps` times, the page cache dropped before
each (root only; otherwise the loads read from the cache, and the script says so). Prints
each load's seconds, then rank 0's profile of the last one (cumulative time, top 45).
"""

from __future__ import annotations

import argparse
import cProfile
import time

from _profile_state import finish, fresh_page_cache, print_profile, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="where the checkpoint is written (removed)")
    args = ap.parse_args()
    ctx, state, root, mgr = start(args.layers, args.out)
    dropped = True
    for rep in range(args.reps):
        dropped &= fresh_page_cache(ctx.rank)
        prof = cProfile.Profile() if rep == args.reps - 1 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        assert mgr.load_latest(state) == 1
        if prof is not None:
            prof.disable()
        print(f"rank {ctx.rank} load {time.perf_counter() - t0:.3f} s", flush=True)
        if prof is not None and ctx.rank == 0:
            print_profile(prof, 45)
    if ctx.rank == 0:
        print("page cache dropped before each load:", "yes" if dropped else "NO (not root)")
    finish(mgr, root, ctx.rank)


if __name__ == "__main__":
    main()
