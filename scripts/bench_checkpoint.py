"""Checkpoint save benchmark: five ways to write the same training state to the same disk.

    .venv/bin/python scripts/bench_checkpoint.py            # full run, several minutes
    .venv/bin/python scripts/bench_checkpoint.py --quick    # smaller state, under a minute

Launches itself under torchrun with 2 ranks (a free port through --standalone) unless it is
already inside torchrun. The state is an FSDP2-sharded stack of nn.Linear with its AdamW
state (each rank's shard distinct). In one run, interleaved, each repetition in a rotated
order, with every output deleted before the next variant:

- torch_save: gather the full state to rank 0, then torch.save + fsync (what tutorials do,
  made durable like the others);
- dcp: plain dcp.save with DCP's default FileSystemWriter;
- sync: our CheckpointManager.save(blocking=True), manifest and commit included;
- async: our CheckpointManager.save() while real training steps run, fenced as the
  manager fences them (an optimizer step pre-hook calling wait_staged(), timed here);
- write2: the disk's own rate, the baseline of every save ratio: each rank writes its half
  of the bytes (random, from memory) in 8 MiB write() calls and fsyncs, as DCP's writer
  does, with nothing else; run at the start and at the end of every repetition;
- write2_drop: the same, the page cache told to drop the pages behind the writes every
  64 MiB as our writer does: the baseline of the same technique (on our VM fresh
  page-cache pages are dear, and write2's time depends on what the run freed before it);
- dd1 / dd2: `dd if=/dev/zero bs=8M conv=fdatasync` of the same byte count, from rank 0
  alone (dd1) or half from each rank at once (dd2), for reference;
- after each sync save, its loads, each from a dropped page cache: read2 (each rank reads the
  files it loads in 8 MiB reads into one buffer, sequential read-ahead, nothing else: the
  baseline of load ratios), load (ours,
  verified in one pass), load2 (ours with verify_buffer_mib=0: check, then read again),
  dcp_load (plain dcp.load, no verification);
- reshard: the same state saved by one rank (a plain copy of the model on rank 0) and loaded
  2 -> 1, 1 -> 2, 1 -> 1 and 2 -> 2, each load checked bitwise (state_digest);
- steps: training steps with no save, the baseline step time.

Before every timed variant the page cache is written back and dropped (`sync; echo 3 >
/proc/sys/vm/drop_caches`, root only; the run says whether it could), so each variant starts
from the same state of the disk, and loads read from the disk. Ratios are paired: each
repetition's ratio against the baselines of the same repetition, then the median over
repetitions.

`--scale` instead saves and loads 64 MiB, 256 MiB, 1 GiB and 4 GiB of state (`--sizes`):
seconds, GB/s and the ratio to write2 at each size, and the resharded loads up to
`--reshard-max-mib`; `--plot FILE.png` draws the curves.

Prints a table of medians and ratios; the last line of stdout is one JSON object with the
ratios, so runs can be compared. Timings are noisy on a shared machine: compare ratios
taken in the same run, never absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller state, 3 repetitions")
    p.add_argument(
        "--dir",
        default=None,
        help="where checkpoints are written (a temporary directory is made inside and "
        "removed afterwards); default ./bench-output/ of the repository",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 3)")
    p.add_argument("--width", type=int, default=None, help="Linear width (default 2048/1024)")
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 12/8)")
    p.add_argument("--batch", type=int, default=None, help="rows per step per rank")
    p.add_argument("--write-threads", type=int, default=1, help="CheckpointConfig.write_threads")
    p.add_argument(
        "--live",
        action="store_true",
        help="also time a prototype async save without staging: it writes from the live "
        "tensors and the optimizer's fence holds the step until the write is done",
    )
    p.add_argument(
        "--stall",
        action="store_true",
        help="time only the async save(s), the baseline steps and the sync save (no loads): "
        "the effective stall, with many repetitions in little time",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the parts of a sync save: DCP without fsync, DCP and our writer with "
        "torch.save's per-record crc32 off, our writer without the manager, write_threads=2",
    )
    p.add_argument(
        "--scale", action="store_true", help="save/load curves over --sizes instead of the table"
    )
    p.add_argument("--sizes", default="64,256,1024,4096", help="--scale: state sizes in MiB")
    p.add_argument(
        "--reshard-max-mib",
        type=int,
        default=1024,
        help="largest state whose resharded loads are measured (rank 0 holds a full copy)",
    )
    p.add_argument("--plot", default=None, help="--scale: write the curves to this PNG")
    p.add_argument("--raw", default=None, help="write every measurement to this JSON file")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick or args.scale else 5)
    args.size_list = [int(x) for x in args.sizes.split(",") if x]
    args.width = args.width or (1024 if args.quick else 2048)
    args.layers = args.layers or (8 if args.quick else 12)
    args.batch = args.batch or (32 if args.quick else 64)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


# ----------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace) -> int:
    """Re-run this file under torchrun with 2 ranks on a free port; clean up afterwards."""
    parent = Path(args.dir) if args.dir else REPO / "bench-output"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=parent))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # c10d rendezvous on localhost, port chosen by the OS
        "--nproc-per-node",
        "2",
        __file__,
        *sys.argv[1:],
        "--workdir",
        str(work),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        return subprocess.call(cmd, env=env)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- worker
from _ckpt_figures import report, scale, stall_report  # noqa: E402  (beside this script)
from _ckpt_variants import Bench  # noqa: E402


def worker(args: argparse.Namespace, *, cleanup: bool) -> None:
    b = Bench(args)
    try:
        if args.scale:
            scale(b)
            b.close_managers()
            return
        b.build(args.width, args.layers)
        res = b.run()
        b.close_managers()
        if args.stall:
            if b.rank == 0:
                stall_report(b, res)
            return
        if hasattr(b, "mgr2"):
            b.mgr2.close()
        if b.rank == 0:
            report(b, res)
            if args.raw:
                Path(args.raw).write_text(json.dumps(res, indent=1))
    finally:
        from resilient.groups.groups import shutdown_distributed

        shutdown_distributed(b.ctx)
        if cleanup and b.rank == 0:
            shutil.rmtree(args.workdir, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    own = args.workdir is None
    if own:  # started by hand under torchrun: every rank derives the same directory
        parent = Path(args.dir) if args.dir else REPO / "bench-output"
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        args.workdir = str(parent / f"bench_ckpt_{run_id}_{os.environ.get('MASTER_PORT', '0')}")
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    worker(args, cleanup=own and not args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
