"""`resilient` on the command line: run training, inspect and verify checkpoints.

resilient run [torchrun flags] script.py [args]   torchrun with restarts, preemption, elastic
resilient ls URL          list checkpoints: step, committed or not, size, world size
resilient verify URL      check every file of the newest (or --step N) checkpoint
resilient report RUN_DIR  goodput, faults and recovery from a run's event logs (--png: timeline)
resilient export URL --to DIR   a checkpoint's model as safetensors or torch.save files
resilient check-resume [torchrun flags] script.py [args]   is stop-and-resume bit-exact?
resilient rendezvous [--port P]   a rendezvous store apart from the training nodes

A location that cannot be used (no credentials, a missing bucket, not a checkpoint location,
a step that is not there) is one line on stderr naming the location and the fix, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from resilient.errors import CheckpointCorruptError, ResilientError

if TYPE_CHECKING:
    from resilient.checkpoint.manager import CheckpointManager
    from resilient.storage import Storage

__all__ = ["main"]

_WHERE_FROM = (
    "point at the directory or URL given to resilient.init (checkpoint_dir) or to "
    "resilient run --checkpoint-url"
)


class _BadInput(Exception):
    """A location or argument the command cannot use: `what`, where, and the fix."""

    def __init__(self, what: str, where: str, fix: str) -> None:
        super().__init__(f"{what}: {where}: {fix}")


def _manager(url: str) -> CheckpointManager:
    # imported here: `resilient run` must not load the checkpoint code (torch DCP) it never uses
    from resilient.checkpoint.manager import CheckpointConfig, CheckpointManager

    return CheckpointManager(CheckpointConfig(url=url))


def _steps(steps: list[int]) -> str:
    shown = steps if len(steps) <= 12 else [*steps[:5], "...", *steps[-5:]]
    return "[" + ", ".join(str(s) for s in shown) + "]"


def _root_kind(storage: Storage) -> str | None:
    """What the location is: "directory" (holding something), "empty" (a directory holding
    nothing), "file", or None when nothing is there (on object stores: no object under the
    prefix). One storage call, under its retry policy and error classification."""

    def look() -> str | None:
        try:
            info = storage.fs.info(storage.root)
        except FileNotFoundError:
            return None
        if info.get("type") != "directory":
            return "file"
        try:
            return "directory" if storage.fs.ls(storage.root, detail=False) else "empty"
        except FileNotFoundError:
            return "empty"

    return storage.call("look", look)


def _no_checkpoints(storage: Storage, *, empty_ok: bool) -> None:
    """Raise _BadInput saying why a location without step_* directories is not usable.

    Returns only for an empty directory with `empty_ok` (a run that has not saved yet)."""
    from resilient.checkpoint.manifest import parse_step_dir

    url = storage.url
    kind = _root_kind(storage)
    if kind is None:
        raise _BadInput("nothing at this location", url, f"check it for typos; {_WHERE_FROM}")
    if kind == "file":
        raise _BadInput("a file, not a checkpoint location", url, _WHERE_FROM)
    step = parse_step_dir(url.rstrip("/").rsplit("/", 1)[-1])
    if step is not None:
        parent = url.rstrip("/").rsplit("/", 1)[0]
        raise _BadInput(
            f"one checkpoint (step {step}), not the location that holds them",
            url,
            f"give its parent: {parent} (with --step {step} to verify this one)",
        )
    if kind == "empty":
        if empty_ok:
            return
        raise _BadInput(
            "no checkpoint yet (the directory is empty)",
            url,
            f"training has not saved here yet; {_WHERE_FROM}",
        )
    raise _BadInput(
        "not a resilient checkpoint location (no step_*/manifest.json)", url, _WHERE_FROM
    )


def _ls(args: argparse.Namespace) -> int:
    from resilient.checkpoint.faults import first_fault_step, read_faults

    mgr = _manager(args.url)
    infos = mgr.list()
    if not infos:
        _no_checkpoints(mgr.storage, empty_ok=True)
        print(f"no checkpoints under {mgr.storage.url} yet (an empty directory)")
        return 0
    # numeric: "good" (checked finite, from before any recorded numerical fault), "after
    # fault" (taken after the faulty step ran), "?" (a manifest from before the check existed)
    first_fault = first_fault_step(read_faults(mgr.storage))
    print(f"{'step':>10}  {'state':<12} {'bytes':>14}  {'world':>5}  {'numeric':<11}  written")
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
        after = first_fault is not None and info.step > first_fault  # N: after N steps
        numeric = "after fault" if after else "good" if m.finite else "?"
        print(
            f"{info.step:>10}  {'committed':<12} {m.total_bytes:>14,}  {m.world_size:>5}  "
            f"{numeric:<11}  {when}"
        )
    if first_fault is not None:
        before = [i.step for i in infos if i.committed and i.step <= first_fault]
        kept = (
            f"step {before[-1]} is the newest checkpoint before it, kept by retention"
            if before
            else "no committed checkpoint from before it is left"
        )
        print(f"numerical fault first recorded at step {first_fault}: {kept}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    url = mgr.storage.url
    infos = mgr.list()
    if not infos:
        _no_checkpoints(mgr.storage, empty_ok=False)
    steps = [i.step for i in infos if i.committed]
    unfinished = [i.step for i in infos if not i.committed]
    if not steps:
        raise _BadInput(
            "no committed checkpoint yet",
            url,
            f"only unfinished saves are there (steps {_steps(unfinished)}), which are never "
            "loaded; let training commit one, or point at another location",
        )
    step = args.step if args.step is not None else steps[-1]
    if step not in steps:
        why = " (its save did not finish)" if step in unfinished else ""
        raise _BadInput(
            f"no committed checkpoint at step {step}{why}",
            url,
            f"it has steps {_steps(steps)}; pass one of them to --step, or leave --step out "
            "for the newest",
        )
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

    run_dir = str(args.run_dir)
    where = _shown(run_dir)
    fix = (
        "pass the run directory of the training run: resilient run --run-dir (default "
        "runs/<rdzv id>), or run_dir/$RESILIENT_RUN_DIR given to resilient.init"
    )
    if "://" in run_dir:
        raise _BadInput(
            "report reads a local run directory, not a URL",
            where,
            "copy the run directory to this machine (e.g. aws s3 sync) and pass its path",
        )
    if not os.path.exists(run_dir):
        raise _BadInput("no such run directory", where, fix)
    if not os.path.isdir(run_dir):
        raise _BadInput("a file, not a run directory", where, fix)
    try:
        rep = analyze(run_dir, mtbf_s=args.mtbf)
    except FileNotFoundError:
        raise _BadInput("not a run directory (no event logs in logs/*.jsonl)", where, fix) from None
    print(format_report(rep))
    if args.png:
        print(f"timeline: {plot_timeline(run_dir, args.png)}")
    return 0


def _shown(location: str) -> str:
    """`location` as it may be shown: without user:password@ or any known credential."""
    from resilient.storage.redact import hide_userinfo, redact, userinfo_secrets

    return redact(hide_userinfo(location), tuple(userinfo_secrets(location)))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # imported when the command may be export: the module loads torch only when one runs
    from resilient.weights import export

    p = export.add_parser(sub)
    p.set_defaults(fn=export.main)


def _live_monitor(*args: Any, **kwargs: Any) -> Any:
    """resilient.live's LiveMonitor, imported only when a run asks for metrics or a status
    line; handed to the supervisor, which imports nothing of the live view itself."""
    from resilient.live.monitor import LiveMonitor

    return LiveMonitor(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # torchrun's flags: its own parser reads them (supervisor/config.py)
        from resilient.supervisor import main as run_main

        return run_main(argv[1:], live=_live_monitor)
    if argv[:1] == ["rendezvous"]:  # a store server apart from the job (supervisor/store_server.py)
        from resilient.supervisor.store_server import main as rendezvous_main

        return rendezvous_main(argv[1:])
    if argv[:1] == ["check-resume"]:  # torchrun's flags too: parsed there (replay/check_resume.py)
        from resilient.live.status import StatusLine
        from resilient.replay.check_resume import main as check_main

        line = StatusLine(mode="auto", every_s=15.0, prefix="check-resume: ")
        line.own_stderr()
        try:
            return check_main(argv[1:], progress=line)
        finally:
            line.close()
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
    sub.add_parser(
        "rendezvous",
        help="serve a rendezvous store apart from the training nodes (resilient rendezvous --help)",
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
    if argv[:1] not in (["ls"], ["verify"], ["report"]):
        _add_export(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except (_BadInput, ResilientError) as e:  # StorageError included: it names the fix
        print(f"resilient: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a local path this user cannot read: not a bug of ours
        where = next(
            (getattr(args, a) for a in ("url", "run_dir", "src") if getattr(args, a, None)), None
        )
        what = f"cannot read {_shown(str(where))}" if where else "cannot read"
        print(
            f"resilient: {what}: {_one_line(_shown(str(e)))}: check the path and that this "
            "user may read it",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
