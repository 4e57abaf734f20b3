"""Where a blocking checkpoint save's time goes, against the disk in the same minutes.

    .venv/bin/torchrun --nproc-per-node 2 scripts/profile_save.py --layers 85 --out DIR

Builds FSDP2 + AdamW state of `--layers` x Linear(2048, 2048) on 2 ranks (85 layers: about
4 GiB, 21: about 1 GiB) and saves it `--reps` + 1 times to DIR with keep_last=1, as a run
with a full retention window does: from the second save on, each save's retention deletes
the previous checkpoint. Before each timed save every rank writes the bytes of its own files
with 8 MiB `write()`s and `fsync`s them (`write2` of bench_checkpoint.py), then the same
dropping its pages behind it as the checkpoint writer does (`write2-drop`), the page cache
dropped before each (root only; the script says whether it could). Prints each save's
seconds (barrier to barrier; and when rank 0's `save()` returned), the baselines' and their
ratios; with `--profile`, rank 0's cProfile of the last save (cumulative time, top 40).
Retention, where it runs beside the loop, is waited for outside the timings.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import time
from pathlib import Path

import torch.distributed as dist
from _ckpt_variants import write_baseline
from _profile_state import finish, fresh_page_cache, print_profile, start

_BLOCK = os.urandom(8 << 20)  # what write2 writes, over and over


def _timed_write2(path: Path, nbytes: int, rank: int, *, drop_behind: bool) -> tuple[float, bool]:
    """Seconds of write2 on every rank, barrier to barrier, from a dropped page cache."""
    dropped = fresh_page_cache(rank)
    t0 = time.perf_counter()
    write_baseline(path, nbytes, _BLOCK, drop_behind=drop_behind)
    dist.barrier()
    took = time.perf_counter() - t0
    path.unlink()
    return took, dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="where the checkpoints are written (removed)")
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's last save")
    args = ap.parse_args()
    ctx, state, root, mgr = start(args.layers, args.out)
    mine = sum(p.stat().st_size for p in (root / "step_000000001").glob(f"__{ctx.rank}_*.distcp"))
    dropped = True
    for rep in range(args.reps):
        baseline = root / f"write2-{ctx.rank}.bin"
        disk, ok = _timed_write2(baseline, mine, ctx.rank, drop_behind=False)
        disk_drop, ok2 = _timed_write2(baseline, mine, ctx.rank, drop_behind=True)
        ok3 = fresh_page_cache(ctx.rank)  # a collective: every rank calls it, whatever ok was
        dropped &= ok and ok2 and ok3
        prof = cProfile.Profile() if args.profile and rep == args.reps - 1 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        mgr.save(state, rep + 2, blocking=True)
        if prof is not None:
            prof.disable()
        returned = time.perf_counter() - t0
        dist.barrier()
        took = time.perf_counter() - t0
        mgr.wait()  # the retention it started, before the next baseline
        dist.barrier()
        if ctx.rank == 0:
            print(
                f"save {took:.3f} s (rank 0's save() returned at {returned:.3f} s)  "
                f"write2 {disk:.3f} s  write2-drop {disk_drop:.3f} s  "
                f"write2 / save {disk / took:.2f}  write2-drop / save {disk_drop / took:.2f}"
            )
        if prof is not None and ctx.rank == 0:
            print_profile(prof, 40)
    if ctx.rank == 0:
        print(
            f"{mine * ctx.world_size / 1e9:.2f} GB a save; page cache dropped before each:",
            "yes" if dropped else "NO (not root)",
        )
    finish(mgr, root, ctx.rank)


if __name__ == "__main__":
    main()
