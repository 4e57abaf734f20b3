"""`resilient` on the command line: run training, inspect and verify checkpoints.

resilient run [torchrun flags] script.py [args]   torchrun with restarts, preemption, elastic
resilient ls URL          list checkpoints: step, committed or not, size, world size
resilient verify URL      check every file of the newest (or --step N) checkpoint
resilient report RUN_DIR  goodput, faults and recovery from a run's event logs (--png: timeline)
resilient check-resume [torchrun flags] script.py [args]   is stop-and-resume bit-exact?
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from resilient.errors import CheckpointCorruptError, ResilientError

if TYPE_CHECKING:
    from resilient.checkpoint.manager import CheckpointManager

__all__ = ["main"]


def _manager(url: str) -> CheckpointManager:
    # imported here: `resilient run` must not load the checkpoint code (torch DCP) it never uses
    from resilient.checkpoint.manager import CheckpointConfig, CheckpointManager

    return CheckpointManager(CheckpointConfig(url=url))


def _ls(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    infos = mgr.list()
    if not infos:
        print(f"no checkpoints under {args.url}")
        return 0
    print(f"{'step':>10}  {'state':<12} {'bytes':>14}  {'world':>5}  written")
    for info in infos:
        if not info.committed:
            print(f"{info.step:>10}  {'unfinished':<12}")
            continue
        try:
            m = mgr.read_manifest(info.step)
        except CheckpointCorruptError as e:
            print(f"{info.step:>10}  {'bad manifest':<12} {e}")
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at))
        print(f"{info.step:>10}  {'committed':<12} {m.total_bytes:>14,}  {m.world_size:>5}  {when}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    steps = [i.step for i in mgr.list() if i.committed]
    if not steps:
        print(f"no committed checkpoint under {args.url}", file=sys.stderr)
        return 2
    step = args.step if args.step is not None else steps[-1]
    if step not in steps:
        print(f"no committed checkpoint at step {step} (have {steps})", file=sys.stderr)
        return 2
    try:
        manifest = mgr.read_manifest(step)
    except CheckpointCorruptError as e:
        print(f"step {step}: INVALID: {e}")
        return 1
    problems = mgr.verify(step, manifest)  # a single process checks every file
    if problems:
        print(f"step {step}: INVALID")
        for p in problems:
            print(f"  {p}")
        return 1
    print(
        f"step {step}: OK ({len(manifest.files)} files, {manifest.total_bytes:,} bytes, "
        f"saved by {manifest.world_size} rank(s))"
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from resilient.report import analyze, format_report, plot_timeline

    try:
        rep = analyze(args.run_dir, mtbf_s=args.mtbf)
    except FileNotFoundError as e:
        print(f"resilient: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    if args.png:
        print(f"timeline: {plot_timeline(args.run_dir, args.png)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # torchrun's flags: its own parser reads them (supervisor/config.py)
        from resilient.supervisor import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["check-resume"]:  # torchrun's flags too: parsed there (replay/check_resume.py)
        from resilient.replay.check_resume import main as check_main

        return check_main(argv[1:])
    parser = argparse.ArgumentParser(prog="resilient", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "run",
        help="run a script under torch elastic with restarts, preemption and elastic resume "
        "(resilient run --help)",
        add_help=False,
    )
    sub.add_parser(
        "check-resume",
        help="run a script straight and stopped-then-resumed on scratch directories and "
        "compare every step (resilient check-resume --help)",
        add_help=False,
    )
    p = sub.add_parser("ls", help="list the checkpoints under a location")
    p.add_argument("url", help="checkpoint directory or fsspec URL")
    p.set_defaults(fn=_ls)
    p = sub.add_parser("verify", help="verify a checkpoint's files against its manifest")
    p.add_argument("url", help="checkpoint directory or fsspec URL")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed")
    p.set_defaults(fn=_verify)
    p = sub.add_parser("report", help="goodput, faults and recovery from a run's event logs")
    p.add_argument("run_dir", help="the run directory (holds logs/rank*.jsonl)")
    p.add_argument("--png", default=None, help="also draw the timeline into this PNG file")
    p.add_argument(
        "--mtbf",
        type=float,
        default=None,
        help="mean time between failures for the Young/Daly optimum, in seconds "
        "(default: measured from the run)",
    )
    p.set_defaults(fn=_report)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except ResilientError as e:
        print(f"resilient: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
